"""What an evaluation runs against: each named step of the trained model, served as its own adapter version on the
model's one engine, and reference models behind any OpenAI-compatible endpoint; and the per-target view of the
model that the unchanged rollout receives (its inference name, endpoint and client point at the target).

Step 0 is the model before training: its step-0 checkpoint, LoRA's initial adapter, whose update is zero, so it
answers exactly as the base model does (LocalBackend rebuilds it when that checkpoint was deleted). "latest" is the
step the backend serves as newest. A backend that can serve older
versions (`LocalBackend`: `checkpoint_steps` and `serve_step`) serves any checkpointed step; another backend
serves only its newest."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from pydantic import PrivateAttr

from ..model import Model, TrainableModel

StepSpec = int | str  # a step number, or "latest"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True)
class Reference:
    """Another model to evaluate beside the steps: `model` at an OpenAI-compatible `base_url`. The API key is read
    from the environment variable `api_key_env` (never passed as a value, so it stays off command lines); None
    sends none. `label` names it in the results (default: `model`)."""

    model: str
    base_url: str
    api_key_env: str | None = "OPENAI_API_KEY"
    label: str | None = None

    def __post_init__(self) -> None:
        env = self.api_key_env
        if env is not None and not (isinstance(env, str) and _ENV_NAME.fullmatch(env)):
            # not echoed: what stands here is often the key itself, which must not reach logs
            raise ValueError(
                f"reference {self.name!r}: api_key_env must be the NAME of the environment variable holding its key "
                "(letters, digits, _), not the key itself: a key never goes on a command line or into code"
            )

    @property
    def name(self) -> str:
        return self.label or self.model


@dataclass(frozen=True)
class Target:
    """One thing evaluated: a step (`step` set) or a reference (`step` None), and where its requests go."""

    label: str
    step: int | None
    base_url: str
    api_key: str
    model_name: str
    token_ids: bool = False


@runtime_checkable
class ServesSteps(Protocol):
    """A backend that can serve any checkpointed step of a model as its own version."""

    async def checkpoint_steps(self, model: TrainableModel) -> list[int]: ...

    async def serve_step(self, model: TrainableModel, step: int) -> str: ...


def step_label(step: int) -> str:
    return f"step {step}"


def check_steps(steps: list[StepSpec]) -> list[StepSpec]:
    """The steps asked for, checked: ints >= 0 or "latest" (digits in text become ints); at least one."""
    out: list[StepSpec] = []
    for step in steps:
        if isinstance(step, str) and step.strip().isdigit():
            step = int(step.strip())
        if isinstance(step, bool) or not (isinstance(step, int) and step >= 0 or step == "latest"):
            raise ValueError(f"unknown step {step!r}: a step is a checkpoint number (>= 0) or 'latest'")
        out.append(step)
    return out


async def step_targets(model: TrainableModel, steps: list[StepSpec]) -> list[Target]:
    """A target per distinct step, served on the model's engine; a step with no checkpoint is refused."""
    backend = model.backend()  # an unregistered model fails here, naming the fix
    latest = (
        await model.get_step()
    )  # the step the backend serves as newest (a checkpoint being written is not)
    served = isinstance(backend, ServesSteps)
    available = sorted(await backend.checkpoint_steps(model)) if served else [latest]  # type: ignore[union-attr]
    numbers: list[int] = []
    for step in steps:
        number = latest if step == "latest" else int(step)
        if number not in available:
            where = (
                f"its checkpoints are {available}"
                if served
                else f"{type(backend).__name__} serves only its newest step ({latest})"
            )
            raise ValueError(f"step {number} of model {model.name!r} has no checkpoint to serve ({where})")
        if number not in numbers:
            numbers.append(number)
    if model.inference_base_url is None:
        raise RuntimeError(f"model {model.name!r} has no inference endpoint: register it first")
    endpoint = getattr(model, "_endpoint", None)
    token_ids = bool(getattr(endpoint, "supports_token_ids", False))
    targets = []
    for number in numbers:
        if served:
            name = await backend.serve_step(model, number)  # type: ignore[union-attr]
        else:
            name = model.get_inference_name(number)
        targets.append(
            Target(
                label=step_label(number),
                step=number,
                base_url=model.inference_base_url,
                api_key=model.inference_api_key or "none",
                model_name=name,
                token_ids=token_ids,
            )
        )
    return targets


def reference_target(reference: Reference) -> Target:
    """The target of a reference model; its API key comes from the environment now (a missing one is refused)."""
    if not reference.base_url.startswith(("http://", "https://")):
        raise ValueError(
            f"reference {reference.name!r}: base_url must be an http(s) URL, not {reference.base_url!r}"
        )
    key = "none"
    if reference.api_key_env is not None:
        key = os.environ.get(reference.api_key_env, "")
        if not key:
            raise ValueError(
                f"reference {reference.name!r}: environment variable {reference.api_key_env} (its API key) is not "
                "set; set it, or pass api_key_env=None for an endpoint without a key"
            )
    return Target(
        label=reference.name,
        step=None,
        base_url=reference.base_url.rstrip("/"),
        api_key=key,
        model_name=reference.model,
    )


# ---- the model a rollout sees ------------------------------------------------------------------------------------


class _TargetView:
    """Mixed into a copy of the user's model class: the copy names, reaches and reports the evaluated target, and
    refuses to train (an evaluation never changes weights)."""

    _eval_target: Target

    def get_inference_name(self, step: int | None = None) -> str:
        return self._eval_target.model_name

    async def get_step(self) -> int:
        return self._eval_target.step or 0

    async def register(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError("an evaluation's view of a model cannot be registered; register the model itself")

    async def train(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        raise RuntimeError(
            "a rollout under evaluation cannot train the model (its weights are being evaluated)"
        )

    async def train_sft(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await self.train()

    async def delete_checkpoints(self, *args: Any, **kwargs: Any) -> list[int]:
        raise RuntimeError("a rollout under evaluation cannot delete checkpoints")


_VIEW_CLASSES: dict[type, type] = {}


def _view_class(cls: type[Model]) -> type[Model]:
    view = _VIEW_CLASSES.get(cls)
    if view is None:
        namespace = {"__module__": __name__, "_eval_target": PrivateAttr(default=None)}
        view = _VIEW_CLASSES[cls] = type(f"Evaluated{cls.__name__}", (_TargetView, cls), namespace)
    return view


def target_view(model: Model, target: Target) -> Model:
    """A copy of `model` whose inference name, endpoint and `openai_client()` are the target's (`model` unchanged).
    A reference's view is not trainable and asks for no token ids (it is not our engine)."""
    update: dict[str, Any] = {
        "inference_base_url": target.base_url,
        "inference_api_key": target.api_key,
        "inference_model_name": target.model_name,
    }
    if target.step is None:
        update["trainable"] = False
    fields = {**dict(model.__dict__), **update}
    view = _view_class(type(model)).model_construct(_fields_set=set(model.model_fields_set), **fields)
    private = dict(model.__pydantic_private__ or {})
    private.update(_client=None, _eval_target=target)
    if target.step is None:
        private.update(_endpoint=None, _backend=None)
    object.__setattr__(view, "__pydantic_private__", private)
    return view
