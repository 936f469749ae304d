"""Where art.evaluate and art.Evaluation send a finished result besides its JSON file: the report page, W&B and
Langfuse. A sink that fails warns once, naming itself, and never loses the result (its JSON is written first)."""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .results import EvalResult
from .sinks import REPORT_PAGE, log_langfuse, log_wandb, wandb_metrics, write_page


def model_folder(model: Any) -> Path | None:
    """The model's folder on its backend (LocalBackend's `{path}/{project}/models/{name}`); None for a backend
    without one (RemoteBackend) or a model not registered."""
    backend = getattr(model, "_backend", None)
    folder = getattr(backend, "model_dir", None)
    return Path(folder(model)) if callable(folder) else None


def report_page_path(model: Any, beside: str | Path | None) -> Path | None:
    """Where the report page goes: `evaluation.html` in the model's folder (the training report links it); without
    a folder, `beside` (the JSON output) with the suffix .html (`-page.html` when the output is itself named .html,
    which the page must not replace); None when neither is known (no page)."""
    folder = model_folder(model)
    if folder is not None:
        return folder / REPORT_PAGE
    if beside is None:
        return None
    beside = Path(beside)
    page = beside.with_suffix(".html")
    return page if page != beside else beside.with_name(f"{beside.stem}-page.html")


def check_sinks(wandb: Any, langfuse: Any) -> None:
    """Refuse a sink of the wrong kind before anything runs (a sink that is down only warns, later)."""
    if wandb is not None and not (hasattr(wandb, "log_step") or callable(getattr(wandb, "log", None))):
        raise TypeError(f"wandb= must be a WandbLogger or a wandb Run, not {type(wandb).__name__}")
    exporter = hasattr(langfuse, "export") and hasattr(langfuse, "client")
    if langfuse is not None and not (exporter or callable(getattr(langfuse, "run_experiment", None))):
        raise TypeError(
            f"langfuse= must be a LangfuseExporter or a langfuse.Langfuse, not {type(langfuse).__name__}"
        )


def plain_scenario(scenario: Any) -> Any:
    """A scenario as JSON (a Langfuse dataset item's input): dataclasses and pydantic models as their fields, other
    objects as their public attributes, anything JSON cannot hold as its str."""
    if dataclasses.is_dataclass(scenario) and not isinstance(scenario, type):
        scenario = dataclasses.asdict(scenario)
    elif callable(getattr(scenario, "model_dump", None)):
        scenario = scenario.model_dump(mode="json")
    elif not isinstance(scenario, dict | list | tuple | str | int | float | bool) and hasattr(
        scenario, "__dict__"
    ):
        scenario = {k: v for k, v in vars(scenario).items() if not k.startswith("_")}
    return json.loads(json.dumps(scenario, default=_json_default))


def _json_default(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


@dataclasses.dataclass
class Publisher:
    """The sinks of one evaluation (or of a training run's evaluations): `page` (None: no page), a WandbLogger or
    wandb Run, a LangfuseExporter or langfuse.Langfuse. Each sink that fails warns the first time only."""

    page: Path | None = None
    wandb: Any = None
    langfuse: Any = None
    warned: set[str] = dataclasses.field(default_factory=set)
    _wandb_axis: bool = dataclasses.field(default=False, repr=False)

    def publish(
        self,
        result: EvalResult,
        *,
        scenarios: Mapping[str, Any] | None = None,
        step: int | None = None,
        targets: Sequence[str] | None = None,
    ) -> Path | None:
        """The page, then W&B and Langfuse (publish_sinks). Returns the page written (None: none)."""
        page = self.publish_page(result)
        self.publish_sinks(result, scenarios=scenarios, step=step, targets=targets)
        return page

    def publish_page(self, result: EvalResult) -> Path | None:
        """Write the page (when there is a place for it); returns it, or None."""
        page, written = self.page, []
        if page is not None:
            self._try("the report page", lambda: written.append(write_page(result, page)))
        return written[0] if written else None

    def publish_sinks(
        self,
        result: EvalResult,
        *,
        scenarios: Mapping[str, Any] | None = None,
        step: int | None = None,
        targets: Sequence[str] | None = None,
    ) -> None:
        """W&B at `step` (None: the run's current step; see log_wandb_at); Langfuse for `targets` (None: all) with `scenarios`
        (id -> scenario, made JSON by plain_scenario) as the dataset items' inputs."""
        if self.wandb is not None:
            self._try("W&B", lambda: self.log_wandb_at(result, step))
        if self.langfuse is not None:

            def to_langfuse() -> None:
                inputs = {sid: plain_scenario(s) for sid, s in (scenarios or {}).items()}
                log_langfuse(result, self.langfuse, scenarios=inputs, targets=targets)

            self._try("Langfuse", to_langfuse)

    def log_wandb_at(self, result: EvalResult, step: int | None) -> None:
        """W&B metrics of the evaluation of training step `step`, on the axis `eval/step` (W&B's define_metric)
        rather than at W&B's own step: an evaluation runs beside training, so it usually finishes after the run has
        logged later steps, and W&B drops rows logged at a step below its current one."""
        if step is None:
            log_wandb(result, self.wandb)
            return
        run = (
            self.wandb.run if hasattr(self.wandb, "log_step") else self.wandb
        )  # a WandbLogger, or a wandb Run
        if run is None:  # a WandbLogger whose W&B is disabled
            return
        if not self._wandb_axis:
            run.define_metric("eval/step")
            run.define_metric("eval/*", step_metric="eval/step")
            self._wandb_axis = True
        run.log({**wandb_metrics(result), "eval/step": step})

    def _try(self, sink: str, call: Callable[[], Any]) -> None:
        try:
            call()
        except Exception as error:  # a sink that is down must not lose the evaluation
            if sink in self.warned:
                return
            self.warned.add(sink)
            warnings.warn(
                f"evaluation: {sink} was not updated ({type(error).__name__}: {error}); the result is kept "
                f"(returned, and in its JSON file when output= is given); further {sink} failures of this "
                "evaluation are not repeated",
                RuntimeWarning,
                stacklevel=2,
            )
