"""`art_adapters.utils.deployment` (ART's names): Together's upload/job API against a local server that speaks it
(the presigned archive fetched from a real local S3), W&B artifacts (offline), and our export for any vLLM server
(the LoRA folder, or merged weights that give the adapter's logprobs)."""

from __future__ import annotations

import asyncio
import io
import shlex
import threading
import zipfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

import art_adapters as art
from art_adapters.tiny import tiny_model_path
from art_adapters.utils.deployment import (
    DeploymentError,
    TogetherDeploymentConfig,
    VLLMExportConfig,
    WandbDeploymentConfig,
    deploy_model,
)
from art_adapters.utils.deployment.together import together_model_name
from fixtures_s3 import BUCKET
from test_remote_backend import running
from test_vllm_server import peft_model_of, write_adapter

KEY = "together-key"


class TogetherStandIn:
    """Together's `/v1/models` (upload an adapter from a URL) and `/v1/jobs` API, as its docs describe it; a job
    is Queued on the first poll, then Complete (or Failed, when asked)."""

    def __init__(self, fail: bool = False, queued_polls: int = 1) -> None:
        self.fail = fail
        self.queued_polls = queued_polls
        self.chats: list[dict[str, Any]] = []
        self.jobs: dict[str, dict[str, Any]] = {}
        self.uploads: list[dict[str, Any]] = []
        self.archives: list[list[str]] = []
        self.lock = threading.Lock()

    def app(self) -> Starlette:
        async def models(request: Request) -> JSONResponse:
            if request.headers.get("authorization") != f"Bearer {KEY}":
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            body = await request.json()
            assert body["model_type"] == "adapter" and body["base_model"] and body["model_name"]
            async with httpx.AsyncClient() as client:  # Together fetches the archive from the presigned URL
                archive = (await client.get(body["model_source"])).content
            self.archives.append(sorted(zipfile.ZipFile(io.BytesIO(archive)).namelist()))
            job_id = f"job-{len(self.jobs) + 1}"
            self.uploads.append(body)
            self.jobs[job_id] = {"name": body["model_name"], "polls": 0}
            return JSONResponse({"data": {"job_id": job_id}})

        async def jobs(request: Request) -> JSONResponse:
            data = [
                {"job_id": j, "args": {"modelName": f"acct/{v['name']}"}, "updated_at": j}
                for j, v in self.jobs.items()
            ]
            return JSONResponse({"data": data})

        async def job(request: Request) -> JSONResponse:
            job = self.jobs[request.path_params["job_id"]]
            job["polls"] += 1
            status = "Queued" if job["polls"] <= self.queued_polls else ("Error" if self.fail else "Complete")
            return JSONResponse(
                {
                    "status": status,
                    "args": {"modelName": f"acct/{job['name']}"},
                    "status_updates": [{"message": "the weights do not fit" if self.fail else "ok"}],
                }
            )

        async def chat(request: Request) -> JSONResponse:
            """Serverless inference on a deployed adapter (it always plays B2)."""
            if request.headers.get("authorization") != f"Bearer {KEY}":
                return JSONResponse({"error": "unauthorized"}, status_code=401)
            body = await request.json()
            deployed = {f"acct/{job['name']}" for job in self.jobs.values()}
            if body.get("model") not in deployed:
                return JSONResponse({"error": {"message": f"no model {body.get('model')}"}}, status_code=404)
            self.chats.append(body)
            message = {"role": "assistant", "content": "<move>B2</move>"}
            return JSONResponse(
                {
                    "id": f"chat-{len(self.chats)}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [{"index": 0, "finish_reason": "stop", "message": message}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14},
                }
            )

        return Starlette(
            routes=[
                Route("/v1/chat/completions", chat, methods=["POST"]),
                Route("/v1/models", models, methods=["POST"]),
                Route("/v1/jobs", jobs, methods=["GET"]),
                Route("/v1/jobs/{job_id}", job, methods=["GET"]),
            ]
        )


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    folder = write_adapter(tiny_model_path(), tmp_path / "checkpoints" / "0003", seed=5)
    (folder / "optimizer.pt").write_bytes(b"state")
    return folder


def trained() -> art.TrainableModel:
    return art.TrainableModel(name="tic-001", project="games", base_model=str(tiny_model_path()))


async def test_together_uploads_the_zipped_adapter_and_waits_for_its_job(
    s3_server: object,
    checkpoint: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    together = TogetherStandIn()
    with running(together.app()) as url:
        monkeypatch.setenv("TOGETHER_BASE_URL", url)
        config = TogetherDeploymentConfig(s3_bucket=BUCKET, poll_every_s=0.01)
        with pytest.raises(DeploymentError, match="TOGETHER_API_KEY"):
            await deploy_model(trained(), str(checkpoint), 3, "together", config)
        monkeypatch.setenv("TOGETHER_API_KEY", KEY)
        result = await deploy_model(trained(), str(checkpoint), 3, "together", config)
        name = together_model_name(trained(), 3)
        assert result.inference_model_name == f"acct/{name}"  # a name with "/": a plain art.Model takes it
        assert name.startswith("games-tic-001-3-")
        assert together.archives == [  # the adapter alone: never the optimizer's state
            sorted(["adapter_config.json", "adapter_model.safetensors", "README.md"])
        ]
        again = await deploy_model(trained(), str(checkpoint), 3, "together", config)
        assert (
            again.inference_model_name == result.inference_model_name and len(together.uploads) == 1
        )  # reused
        deployed = art.Model(
            name=result.inference_model_name, project="games", inference_base_url=f"{url}/v1"
        )
        assert deployed.name == f"acct/{name}"
    failing = TogetherStandIn(fail=True)
    with running(failing.app()) as url:
        monkeypatch.setenv("TOGETHER_BASE_URL", url)
        with pytest.raises(DeploymentError, match="the weights do not fit"):
            await deploy_model(trained(), str(checkpoint), 3, "together", config)


async def test_the_export_serves_the_same_policy_as_the_adapter(checkpoint: Path, tmp_path: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    lora = await deploy_model(
        trained(), str(checkpoint), 3, "vllm", VLLMExportConfig(out_dir=str(tmp_path / "lora"))
    )
    assert sorted(await asyncio.to_thread(lambda: [p.name for p in Path(lora.path or "").iterdir()])) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]  # no optimizer state: a serving folder
    name = together_model_name(trained(), 3)
    assert lora.inference_model_name == name
    assert lora.command and f"--lora-modules {name}=" in lora.command and "--max-lora-rank 8" in lora.command
    merged = await deploy_model(
        trained(), str(checkpoint), 3, "vllm", VLLMExportConfig(out_dir=str(tmp_path / "merged"), merged=True)
    )
    assert merged.command == f"vllm serve {merged.path} --served-model-name {name}"
    ids = torch.tensor([[1, 5, 9, 20, 33, 41]])
    with torch.no_grad():
        want = peft_model_of(tiny_model_path(), checkpoint)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(merged.path)(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-4)
    with pytest.raises(FileExistsError):
        await deploy_model(
            trained(), str(checkpoint), 3, "vllm", VLLMExportConfig(out_dir=str(tmp_path / "lora"))
        )


async def test_wandb_deployment_logs_the_adapter_as_an_artifact(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = await deploy_model(trained(), str(checkpoint), 3, "wandb", WandbDeploymentConfig(entity="me"))
    assert result.inference_model_name == "wandb-artifact:///me/games/tic-001:step3"
    runs: list[bytes] = []
    for _ in range(60):  # wandb's offline writer (its own process) can flush after the run ends: up to 30 s
        runs = await asyncio.to_thread(lambda: [p.read_bytes() for p in tmp_path.rglob("run-*.wandb")])
        if len(runs) == 1 and b"step3" in runs[0]:
            break
        await asyncio.sleep(0.5)
    assert (
        len(runs) == 1 and b"adapter_model.safetensors" in runs[0] and b"step3" in runs[0]
    )  # the logged artifact
    assert b"optimizer.pt" not in runs[0]  # the adapter, never the optimizer's state
    with pytest.raises(TypeError, match="TogetherDeploymentConfig"):
        await deploy_model(trained(), str(checkpoint), 3, "together", None)


async def test_together_never_takes_another_steps_or_projects_job(
    s3_server: object, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Jobs were matched by substring (deploying step 3 after step 30 reused step 30's upload) and names were
    `{project}-{name}-{step}` (project `a-b`, model `c` read as project `a`, model `b-c`)."""
    together = TogetherStandIn(queued_polls=0)
    with running(together.app()) as url:
        monkeypatch.setenv("TOGETHER_BASE_URL", url)
        monkeypatch.setenv("TOGETHER_API_KEY", KEY)
        config = TogetherDeploymentConfig(s3_bucket=BUCKET, poll_every_s=0.01)
        base = str(tiny_model_path())
        first = art.TrainableModel(name="c", project="a-b", base_model=base)
        second = art.TrainableModel(name="b-c", project="a", base_model=base)
        names = [
            (await deploy_model(model, str(checkpoint), step, "together", config)).inference_model_name
            for model, step in ((first, 30), (first, 3), (second, 3))
        ]
    assert len(set(names)) == 3 and len(together.uploads) == 3


def test_the_export_command_is_quoted(checkpoint: Path, tmp_path: Path) -> None:
    from art_adapters.deployment import export_checkpoint

    spaced = tmp_path / "my exports" / "lora; rm -rf ~"
    result = export_checkpoint(trained(), str(checkpoint), 3, VLLMExportConfig(out_dir=str(spaced)))
    assert result.command is not None and shlex.split(result.command)[-1].endswith(f"={spaced}")
