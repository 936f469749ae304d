"""OpenPipe ART's keyword surface mapped onto ours: `backend.train(**kwargs)`, `_config=` knobs, `_internal_config`.

Rule: an ART setting at ART's default is accepted; a value we honour is mapped (each mapping below in one line);
any other value raises `UnsupportedARTSetting` naming the setting and what to do instead. Nothing is silently
ignored, except a setting that only sizes ART's own buffers and cannot change a result (`_NO_EFFECT`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from .config import SFTConfig, TrainConfig


class UnsupportedARTSetting(ValueError):
    """An ART setting this library cannot honour (the message says what to use instead)."""


# ---- results (ART's dataclasses) -------------------------------------------------------------------------------


@dataclass
class TrainResult:
    """What `backend.train(...)` returns: the step after training and the step's metrics."""

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LocalTrainResult(TrainResult):
    """`LocalBackend.train(...)`'s result, with the folder of the checkpoint it wrote."""

    checkpoint_path: str | None = None


@dataclass
class ServerlessTrainResult(TrainResult):
    """ART's ServerlessBackend result type, for annotations in ported code (that backend is not shipped)."""

    artifact_name: str | None = None


# ---- ART's typed dicts (shapes only; `art_adapters.dev` re-exports them) -------------------------------------


class DevTrainConfig(TypedDict, total=False):
    """ART's `art.dev.TrainConfig`: the `_config=` knobs of `model.train` (see `train_config`)."""

    advantage_balance: float
    allow_training_without_logprobs: bool
    epsilon: float
    epsilon_high: float | None
    importance_sampling_level: Literal["token", "sequence", "average", "geometric_average"]
    kimi_k2_tau: float | None
    kl_penalty_coef: float
    logprob_calculation_chunk_size: int
    mask_prob_ratio: bool
    max_negative_advantage_importance_sampling_weight: float
    num_trajectories_learning_rate_multiplier_power: float
    packed_sequence_length: int | None
    plot_tensors: bool
    ppo: bool
    precalculate_logprobs: bool
    scale_learning_rate_by_reward_std_dev: bool
    scale_rewards: bool
    truncated_importance_sampling: float | None


class DevTrainSFTConfig(TypedDict, total=False):
    """ART's `art.dev.TrainSFTConfig` (experimental SFT knobs; none is supported yet, so it must be empty)."""


class InitArgs(TypedDict, total=False):
    max_seq_length: int


class EngineArgs(TypedDict, total=False):
    gpu_memory_utilization: float
    max_model_len: int
    max_num_seqs: int
    enforce_eager: bool
    enable_sleep_mode: bool
    max_lora_rank: int
    max_loras: int


class TrainerArgs(TypedDict, total=False):
    max_grad_norm: float
    weight_decay: float


class DevLoRAConfig(TypedDict, total=False):
    rank: int
    alpha: int
    dropout: float
    target_modules: list[str]
    modules_to_save: list[str] | None


class InternalModelConfig(TypedDict, total=False):
    """ART's `art.dev.InternalModelConfig` (`TrainableModel(_internal_config=...)`); see `internal_settings`.
    `trainer_gpu_ids` / `inference_gpu_ids`: ART's dedicated placement (trainer and engine on their own GPUs)."""

    init_args: InitArgs
    engine_args: EngineArgs
    trainer_args: TrainerArgs
    trainer_gpu_ids: list[int]
    inference_gpu_ids: list[int]


class ServerArgs(TypedDict, total=False):
    pass


class OpenAIServerConfig(TypedDict, total=False):
    """ART's `_openai_client_config` of `register`: accepted when it asks for nothing (engine settings are the
    backend's: `LocalBackend(inference=InferenceConfig(...))` or `art-adapters serve` flags)."""

    server_args: ServerArgs
    engine_args: EngineArgs


# ---- one training step ------------------------------------------------------------------------------------------

# ART setting -> the value at which it asks for nothing we lack.
_ART_DEFAULTS: dict[str, Any] = {
    "loss_fn_config": None,
    "adam_params": None,
    "kl_penalty_reference_step": None,
    "kl_ref_adapter_path": None,
    "kl_penalty_source": "current_learner",
    "kl_penalty_step_lag": None,
    "advantage_balance": 0.0,
    "max_negative_advantage_importance_sampling_weight": None,
    "mask_prob_ratio": False,
    "kimi_k2_tau": None,
    "precalculate_logprobs": False,
    "plot_tensors": False,
    "scale_learning_rate_by_reward_std_dev": False,
    "megatron_topology": None,
    "num_trajectories_learning_rate_multiplier_power": 0.0,
    "save_checkpoint": True,
    "moe_routing_replay_bundle": None,
    "moe_routing_replay_path": None,
    "moe_routing_replay_strict": False,
}
# Settings that only size ART's buffers: any value gives the same step, in ART as here. (ART computes the
# logprobs in chunks of this many tokens to bound memory; the values are the same however it chunks.)
_NO_EFFECT = {"logprob_calculation_chunk_size"}


def train_config(
    base: TrainConfig | None = None, knobs: dict[str, Any] | None = None, *, where: str = "train"
) -> TrainConfig:
    """`base` (ours, or ART's TrainConfig, which is ours) updated by ART's keyword settings `knobs`.

    learning_rate -> learning_rate; allow_training_without_logprobs=True -> train_retokenized_text=True;
    grad_accumulation_sequences: only None (ART's default; see `grad_accumulation_refusal`); loss_fn "cispo" -> loss="cispo", "ppo" -> loss="grpo" (PPO clip);
    ppo=True/False -> the same; importance_sampling_level="sequence" -> loss="gspo" (with PPO clip);
    epsilon / epsilon_high / scale_rewards -> the same; normalize_advantages=False -> scale_rewards=False;
    kl_penalty_coef -> beta (a k3 KL term in the loss, where ART shifts advantages); packed_sequence_length ->
    max_seq_len; truncated_importance_sampling -> the same (TIS cap on the ratio).
    """
    config = (base or TrainConfig()).model_copy()
    update: dict[str, Any] = {}
    normalize = True
    for key, value in (knobs or {}).items():
        if key in _NO_EFFECT or key == "verbose":
            continue
        if key in _ART_DEFAULTS:
            if value != _ART_DEFAULTS[key]:
                raise UnsupportedARTSetting(
                    f"{where}: ART's {key}={value!r} is not supported by art-adapters (only its default "
                    f"{_ART_DEFAULTS[key]!r}); see docs/porting.md"
                )
            continue
        if key == "learning_rate":
            update["learning_rate"] = float(value)
        elif key == "allow_training_without_logprobs":
            # ART trains assistant turns that carry no logprobs (re-rendered by the chat template, NaN logprobs:
            # no importance ratio); ours is `train_retokenized_text`. False is ART's default: nothing to map.
            if value:
                update["train_retokenized_text"] = True
        elif key == "grad_accumulation_sequences":
            if value is not None:
                raise UnsupportedARTSetting(grad_accumulation_refusal(where, value))
        elif key == "loss_fn":
            if value not in ("cispo", "ppo"):
                raise UnsupportedARTSetting(f"{where}: loss_fn must be 'cispo' or 'ppo', not {value!r}")
            update["loss"] = "cispo" if value == "cispo" else "grpo"
        elif key == "ppo":
            update["loss"] = "grpo" if value else "cispo"
        elif key in ("epsilon", "epsilon_high", "scale_rewards", "truncated_importance_sampling"):
            if value is not None:
                update[key] = value
        elif key == "normalize_advantages":  # ART's older alias: False turns the std scaling off
            normalize = bool(value)
        elif key == "kl_penalty_coef":
            update["beta"] = float(value)
        elif key == "packed_sequence_length":
            if value is not None:
                update["max_seq_len"] = int(value)
        elif key == "importance_sampling_level":
            if value not in ("token", "sequence"):
                raise UnsupportedARTSetting(
                    f"{where}: importance_sampling_level={value!r} is not supported; use 'token' or 'sequence'"
                )
            if value == "sequence":
                update["sequence_ratio"] = True
        else:
            raise UnsupportedARTSetting(f"{where}: unknown ART setting {key!r}")
    if not normalize:
        update["scale_rewards"] = False
    if update.pop("sequence_ratio", False):
        if update.get("loss", config.loss) == "cispo":
            raise UnsupportedARTSetting(
                f"{where}: importance_sampling_level='sequence' needs the PPO clip (loss_fn='ppo'): "
                "GSPO is implemented as loss='gspo'"
            )
        update["loss"] = "gspo"
    # Rebuilt from what was set, so a loss chosen here brings its own clip defaults (see TrainConfig).
    fields = {**config.model_dump(exclude_unset=True), **update}
    return TrainConfig(**fields)


def grad_accumulation_refusal(where: str, value: Any) -> str:
    """Why ART's `grad_accumulation_sequences` (sequences per optimizer update: ART takes several updates per
    step) is refused: a step here is one optimizer update over all its sequences."""
    return (
        f"{where}: ART's grad_accumulation_sequences={value!r} (an optimizer update every {value} sequences, "
        "several updates per step) is not supported: art-adapters takes one optimizer update per step over all "
        "its sequences; leave it None, or split the groups over several train calls (one update each)"
    )


def art_backend_train_config(knobs: dict[str, Any], config: TrainConfig | None = None) -> TrainConfig:
    """`backend.train(model, groups, **knobs)` (ART >= 0.5.18): ART's defaults there are CISPO at lr 5e-6. A
    `config` that chooses its loss keeps it (ART's default fills only what neither the config nor a knob sets)."""
    chosen = config is not None and "loss" in config.model_fields_set
    if not chosen and not {"loss_fn", "ppo"} & set(knobs):
        knobs = {"loss_fn": "cispo", **knobs}
    return train_config(config, knobs, where="backend.train")


def sft_config(config: SFTConfig | None, dev: dict[str, Any] | None) -> SFTConfig:
    if dev:
        raise UnsupportedARTSetting(f"train_sft: ART _config knobs {sorted(dev)} are not supported")
    return config or SFTConfig()


# ---- the model's internal config ----------------------------------------------------------------------------------

_ENGINE_FIELDS = set(EngineArgs.__annotations__)


def internal_settings(internal: dict[str, Any] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(inference settings, train defaults) from ART's `_internal_config`.

    init_args.max_seq_length -> the trainer's max_seq_len (`TrainableModel.trainer_max_seq_len()`, what a backend
    loads the trainer for) and TrainConfig.max_seq_len's default (the step's limit); engine_args.{fields of
    EngineArgs} -> InferenceConfig; trainer_args.{max_grad_norm, weight_decay} -> TrainConfig;
    anything else (chat_template_kwargs included: pass `extra_body={"chat_template_kwargs": ...}` per request)
    raises.
    """
    inference: dict[str, Any] = {}
    train: dict[str, Any] = {}
    for section, values in (internal or {}).items():
        if section in ("trainer_gpu_ids", "inference_gpu_ids"):
            ids = gpu_ids(values, f"_internal_config.{section}")
            if section == "inference_gpu_ids" and ids:
                inference["gpu_ids"] = ids
            continue
        values = dict(values or {})
        if section == "init_args":
            for key, value in values.items():
                if key != "max_seq_length":
                    raise UnsupportedARTSetting(f"_internal_config.init_args.{key} is not supported")
                train["max_seq_len"] = int(value)
        elif section == "engine_args":
            unknown = sorted(set(values) - _ENGINE_FIELDS)
            if unknown:
                raise UnsupportedARTSetting(
                    f"_internal_config.engine_args {unknown} are not supported (supported: {sorted(_ENGINE_FIELDS)})"
                )
            inference.update(values)
        elif section == "trainer_args":
            unknown = sorted(set(values) - {"max_grad_norm", "weight_decay"})
            if unknown:
                raise UnsupportedARTSetting(f"_internal_config.trainer_args {unknown} are not supported")
            train.update(values)
        elif section in ("trainer_gpu_ids", "inference_gpu_ids"):
            continue  # placement: `gpu_ids` below
        else:
            raise UnsupportedARTSetting(
                f"_internal_config.{section} is not supported (supported: init_args, engine_args, trainer_args, "
                "trainer_gpu_ids, inference_gpu_ids); for chat_template_kwargs pass "
                "extra_body={'chat_template_kwargs': ...} per request"
            )
    return inference, train


def gpu_ids(value: Any, where: str) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list | tuple) or not all(isinstance(i, int) and i >= 0 for i in value):
        raise UnsupportedARTSetting(f"{where} must be a list of GPU indices, not {value!r}")
    return list(value)


def openai_client_engine_args(config: dict[str, Any] | None) -> dict[str, Any]:
    """ART's `register(backend, _openai_client_config=...)`: its `engine_args` that cannot harm the host (the
    fields of EngineArgs) become this registration's inference settings, honoured by a LocalBackend (a shared
    server keeps every engine setting its operator's). Other engine args and any `server_args` (the engine's
    command line, its environment, its parsers) are refused."""
    config = dict(config or {})
    if config.get("server_args"):
        raise UnsupportedARTSetting(
            f"register(_openai_client_config=...): server_args {sorted(config['server_args'])} are not supported "
            "(the engine's command line is the backend's: LocalBackend(inference=InferenceConfig(...)))"
        )
    unknown_sections = sorted(k for k, v in config.items() if v and k not in ("engine_args", "server_args"))
    if unknown_sections:
        raise UnsupportedARTSetting(
            f"register(_openai_client_config=...): {unknown_sections} are not supported"
        )
    engine = dict(config.get("engine_args") or {})
    unknown = sorted(set(engine) - _ENGINE_FIELDS)
    if unknown:
        raise UnsupportedARTSetting(
            f"register(_openai_client_config=...): engine_args {unknown} are not supported (supported: "
            f"{sorted(_ENGINE_FIELDS)})"
        )
    return engine
