"""Deploying a trained checkpoint: to Together's serverless LoRA inference (its documented `/v1/models` upload and
`/v1/jobs` API), as a W&B artifact, or (ours) exported for any vLLM / OpenAI-compatible server, as the LoRA folder
or as merged weights, with the command that serves it. `art_adapters.utils.deployment` is ART's face of this."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shlex
import shutil
import time
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import httpx
from pydantic import BaseModel

if TYPE_CHECKING:
    from .model import TrainableModel

Provider = Literal["together", "wandb", "vllm"]
TOGETHER_BASE_URL = "https://api.together.xyz"


class DeploymentConfig(BaseModel):
    """A provider's settings."""


class DeploymentResult(BaseModel):
    """What a deployment gives: the name to send as `model`, and (exports) where the files are and how to serve them."""

    inference_model_name: str
    path: str | None = None
    command: str | None = None


class DeploymentError(RuntimeError):
    """A deployment that could not be made (the message says what the provider answered)."""


class TogetherDeploymentConfig(DeploymentConfig):
    """Together: the checkpoint is zipped to `s3_bucket` (`BACKUP_BUCKET` if unset) and Together fetches it from a
    presigned URL. `TOGETHER_API_KEY` authorizes; `TOGETHER_BASE_URL` points elsewhere (a proxy, a test)."""

    s3_bucket: str | None = None
    prefix: str | None = None
    wait_for_completion: bool = True
    timeout_s: float = 300.0
    poll_every_s: float = 15.0


class WandbDeploymentConfig(DeploymentConfig):
    """W&B: the adapter becomes an artifact of the model's project (`entity` defaults to the W&B default)."""

    entity: str | None = None


class VLLMExportConfig(DeploymentConfig):
    """Ours: write the checkpoint to `out_dir` for a vLLM / OpenAI-compatible server: the LoRA folder as is, or
    (`merged=True`) the base model with the adapter merged in (a plain model folder any server loads)."""

    out_dir: str
    merged: bool = False


class TogetherJobStatus(StrEnum):
    QUEUED = "Queued"
    RUNNING = "Running"
    COMPLETE = "Complete"
    FAILED = "Failed"


class LoRADeploymentProvider(StrEnum):
    """ART's older provider names."""

    TOGETHER = "together"
    WANDB = "wandb"


class LoRADeploymentJob(BaseModel):
    """ART's older result shape."""

    status: str
    job_id: str
    model_name: str
    failure_reason: str | None = None


async def deploy_model(
    model: TrainableModel,
    checkpoint_path: str,
    step: int,
    provider: Provider,
    config: DeploymentConfig | None = None,
    verbose: bool = False,
) -> DeploymentResult:
    """Deploy the checkpoint at `checkpoint_path` (step `step` of `model`) with `provider`."""
    if not await asyncio.to_thread(os.path.isdir, checkpoint_path):
        raise FileNotFoundError(f"no checkpoint at {checkpoint_path}")
    agents = await asyncio.to_thread(_agents_of, checkpoint_path)
    if agents and (provider == "together" or getattr(config, "merged", False)):
        raise ValueError(
            f"checkpoint {checkpoint_path} holds per-agent adapters {agents}: "
            f"{'Together serves one adapter' if provider == 'together' else 'merging takes one adapter'}, so "
            "every agent but the shared one would be lost; export the LoRA folders (provider='vllm', "
            "merged=False), which serve each agent under its own name"
        )
    if provider == "together":
        if not isinstance(config, TogetherDeploymentConfig):
            raise TypeError("provider 'together' needs config=TogetherDeploymentConfig(s3_bucket=...)")
        return await deploy_to_together(model, checkpoint_path, step, config, verbose=verbose)
    if provider == "wandb":
        if config is not None and not isinstance(config, WandbDeploymentConfig):
            raise TypeError(f"provider 'wandb' takes a WandbDeploymentConfig, not {type(config).__name__}")
        name = await asyncio.to_thread(deploy_wandb, model, checkpoint_path, step, config, verbose)
        return DeploymentResult(inference_model_name=name)
    if provider == "vllm":
        if not isinstance(config, VLLMExportConfig):
            raise TypeError("provider 'vllm' needs config=VLLMExportConfig(out_dir=...)")
        return await asyncio.to_thread(export_checkpoint, model, checkpoint_path, step, config)
    raise ValueError(f"unknown provider {provider!r}: 'together', 'wandb' or 'vllm'")


# ---- Together --------------------------------------------------------------------------------------------------


def together_model_name(model: TrainableModel, step: int) -> str:
    """`{project}-{name}-{step}-{tag}`: the tag (a digest of project and name) keeps `a-b`/`c` and `a`/`b-c`
    apart, whose names would otherwise read alike."""
    return deployed_name(model, step)


def deployed_name(model: TrainableModel, step: int) -> str:
    """The name a deployed or exported step is served under, one per (project, name, step)."""
    tag = hashlib.sha256(f"{model.project}\0{model.name}".encode()).hexdigest()[:8]
    return f"{model.project}-{model.name}-{step}-{tag}"


async def deploy_to_together(
    model: TrainableModel,
    checkpoint_path: str,
    step: int,
    config: TogetherDeploymentConfig,
    verbose: bool = False,
) -> DeploymentResult:
    """Upload the zipped adapter, ask Together to load it (reusing a job already made for this step unless it
    failed), and wait for it when asked. Returns the name to send as `model` at Together."""
    key = os.environ.get("TOGETHER_API_KEY")
    if not key:
        raise DeploymentError("TOGETHER_API_KEY is not set: Together needs it to deploy a LoRA")
    url = await asyncio.to_thread(
        presigned_archive, model, checkpoint_path, step, config.s3_bucket, config.prefix
    )
    base = os.environ.get("TOGETHER_BASE_URL", TOGETHER_BASE_URL).rstrip("/")
    name = together_model_name(model, step)
    async with httpx.AsyncClient(
        base_url=base, headers={"authorization": f"Bearer {key}"}, timeout=60
    ) as client:
        job = await _existing_job(client, name)
        if job is None or job.status == TogetherJobStatus.FAILED:
            answer = await _checked(
                await client.post(
                    "/v1/models",
                    json={
                        "model_name": name,
                        "model_source": url,
                        "model_type": "adapter",
                        "base_model": model.base_model,
                        "description": f"art-adapters: project {model.project}, model {model.name}, step {step}",
                    },
                )
            )
            job = await _job(client, str(answer["data"]["job_id"]))
        deadline = time.monotonic() + config.timeout_s
        while config.wait_for_completion and job.status in (
            TogetherJobStatus.QUEUED,
            TogetherJobStatus.RUNNING,
        ):
            if time.monotonic() > deadline:
                raise DeploymentError(f"Together job {job.job_id} not done after {config.timeout_s:.0f} s")
            await asyncio.sleep(config.poll_every_s)
            job = await _job(client, job.job_id)
            if verbose:
                print(f"Together job {job.job_id}: {job.status.value}")
    if job.status == TogetherJobStatus.FAILED:
        raise DeploymentError(
            f"Together deployment of {name} failed (job {job.job_id}): {job.failure_reason}"
        )
    return DeploymentResult(inference_model_name=job.model_name)


class _TogetherJob(BaseModel):
    status: TogetherJobStatus
    job_id: str
    model_name: str
    failure_reason: str | None = None


async def _existing_job(client: httpx.AsyncClient, name: str) -> _TogetherJob | None:
    jobs = (await _checked(await client.get("/v1/jobs"))).get("data") or []
    mine = [j for j in jobs if _named(j, name)]
    if not mine:
        return None
    newest = max(mine, key=lambda j: str(j.get("updated_at", "")))
    return await _job(client, str(newest["job_id"]))


def _named(job: dict[str, Any], name: str) -> bool:
    """Whether a job uploads exactly `name` (Together answers `{account}/{name}`): step 3 is not step 30."""
    model_name = str((job.get("args") or {}).get("modelName", ""))
    return model_name == name or model_name.rpartition("/")[2] == name


async def _job(client: httpx.AsyncClient, job_id: str) -> _TogetherJob:
    body = await _checked(await client.get(f"/v1/jobs/{job_id}"))
    updates = body.get("status_updates") or [{}]
    status = str(body.get("status", ""))
    message = updates[-1].get("message")
    if status in ("Error", "Bad") and "409" in str(message):  # already uploaded: Together has the model
        status = TogetherJobStatus.COMPLETE.value
    mapped = {"Error": "Failed", "Bad": "Failed", "Retry Queued": "Queued"}.get(status, status)
    return _TogetherJob(
        status=TogetherJobStatus(mapped),
        job_id=job_id,
        model_name=str((body.get("args") or {}).get("modelName", "")),
        failure_reason=body.get("failure_reason") or (message if mapped == "Failed" else None),
    )


async def _checked(response: httpx.Response) -> dict[str, Any]:
    if response.status_code >= 400:
        raise DeploymentError(
            f"Together answered {response.status_code} to {response.request.url.path}: {response.text[:500]}"
        )
    return response.json()


def presigned_archive(
    model: TrainableModel, checkpoint_path: str, step: int, bucket: str | None, prefix: str | None
) -> str:
    """The checkpoint zipped at ART's place in the bucket, as a presigned URL valid one hour."""
    from .backend import s3

    location = s3.S3Location.of(model.project, model.name, bucket, prefix)
    return s3.presigned_step_archive(location, Path(checkpoint_path), step)


# ---- W&B ---------------------------------------------------------------------------------------------------------


def deploy_wandb(
    model: TrainableModel,
    checkpoint_path: str,
    step: int,
    config: WandbDeploymentConfig | None = None,
    verbose: bool = False,
) -> str:
    """Log the adapter as a W&B artifact (type `lora`, alias `step{step}`); returns its `wandb-artifact:///` name."""
    import wandb

    from .checkpoints import serving_files

    entity = (config.entity if config else None) or model.entity
    run = wandb.init(project=model.project, entity=entity, job_type="deploy", reinit="create_new")
    try:
        artifact = wandb.Artifact(
            model.name, type="lora", metadata={"base_model": model.base_model, "step": step}
        )
        for path in serving_files(checkpoint_path):  # the adapter, never the optimizer's state
            artifact.add_file(str(path), name=path.relative_to(checkpoint_path).as_posix())
        run.log_artifact(artifact, aliases=[f"step{step}", "latest"])
        entity = entity or run.entity or "local"
    finally:
        run.finish()
    name = f"wandb-artifact:///{entity}/{model.project}/{model.name}:step{step}"
    if verbose:
        print(f"deployed {name}")
    return name


# ---- ours: for any vLLM / OpenAI-compatible server -------------------------------------------------------------


def export_checkpoint(
    model: TrainableModel, checkpoint_path: str, step: int, config: VLLMExportConfig
) -> DeploymentResult:
    """The checkpoint as files a server loads, and the command that serves them (vLLM's OpenAI server)."""
    from .checkpoints import TRAINER_ONLY_FILES, agent_checkpoint_dir

    out = Path(config.out_dir)
    name = deployed_name(model, step)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} is not empty")
    out.parent.mkdir(parents=True, exist_ok=True)
    if not config.merged:
        shutil.copytree(
            checkpoint_path, out, ignore=shutil.ignore_patterns(*TRAINER_ONLY_FILES), dirs_exist_ok=True
        )
        agents = _agents_of(out)  # per-agent adapters: each served as `{name}.{adapter}`, as in training
        modules = [f"{name}={out}", *(f"{name}.{a}={agent_checkpoint_dir(out, a)}" for a in agents)]
        lora = ["--enable-lora", "--max-lora-rank", str(_rank(out)), "--lora-modules", *modules]
        if agents:
            lora += ["--max-loras", str(len(modules))]
        command = shlex.join(["vllm", "serve", model.base_model, *lora])
        return DeploymentResult(inference_model_name=name, path=str(out), command=command)
    merge_adapter(model.base_model, checkpoint_path, out)
    command = shlex.join(["vllm", "serve", str(out), "--served-model-name", name])
    return DeploymentResult(inference_model_name=name, path=str(out), command=command)


def _agents_of(checkpoint_path: str | Path) -> list[str]:
    from .checkpoints import checkpoint_agents

    return checkpoint_agents(checkpoint_path)


def merge_adapter(base_model: str, checkpoint_path: str, out: Path) -> Path:
    """The base model with the adapter merged into its weights, saved with its tokenizer (fp32 stays fp32)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .training.quiet import quiet_loading

    with quiet_loading():
        base = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
        merged = PeftModel.from_pretrained(base, checkpoint_path).merge_and_unload()
        merged.save_pretrained(out)
        AutoTokenizer.from_pretrained(base_model).save_pretrained(out)
    return out


def _rank(adapter_dir: Path) -> int:
    from .inference.config import adapter_rank

    return adapter_rank(adapter_dir)
