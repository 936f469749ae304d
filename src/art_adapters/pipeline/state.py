"""What a pipeline run counts and keeps in the model's state (ART's `_pipeline_trainer` keys, so its runs and
ours resume alike), and the history rows a crash can leave behind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..model import TrainableModel

STATE_KEY = "_pipeline_trainer"


@dataclass
class PipelineState:
    """The run's counters; everything but the live ones is persisted after each step."""

    policy_version: int = 0  # the newest version served (rollouts started now sample it)
    training_step: int = 0  # the step the trainer is producing (policy_version + 1 while a step runs)
    scenario_offset: int = 0
    total_scenarios_consumed: int = 0
    accepted_trainable_groups: int = 0
    discarded_stale_groups: int = 0
    discarded_zero_variance_groups: int = 0
    rollout_errors: int = 0
    last_eval_step: int | None = None
    completed_eval_steps: set[int] = field(default_factory=set)
    offsets: dict[str, int] = field(default_factory=dict)  # step -> scenario offset noted before it trained

    def restore(self, saved: dict[str, Any], start: int) -> int:
        """Take over a previous run's counters; returns the scenarios to skip to resume at step `start`."""
        self.policy_version = self.training_step = start
        for name in (
            "accepted_trainable_groups",
            "discarded_stale_groups",
            "discarded_zero_variance_groups",
            "rollout_errors",
        ):
            setattr(self, name, int(saved.get(name, 0) or 0))
        if saved.get("last_eval_step") is not None:
            self.last_eval_step = int(saved["last_eval_step"])
        self.completed_eval_steps = {int(s) for s in saved.get("completed_eval_steps") or []}
        self.offsets = {str(k): int(v) for k, v in (saved.get("offsets") or {}).items()}
        # noted before each step trained, so a run killed between its checkpoint and its log resumes exactly there
        offset = int(self.offsets.get(str(start), saved.get("scenario_offset", 0)) or 0)
        self.total_scenarios_consumed = int(saved.get("total_scenarios_consumed", offset) or 0)
        return offset

    def persisted(self, training_step: int) -> dict[str, Any]:
        return {
            STATE_KEY: {
                "scenario_offset": self.scenario_offset,
                "total_scenarios_consumed": self.total_scenarios_consumed,
                "training_step": training_step,
                "last_eval_step": self.last_eval_step,
                "completed_eval_steps": sorted(self.completed_eval_steps),
                "accepted_trainable_groups": self.accepted_trainable_groups,
                "discarded_stale_groups": self.discarded_stale_groups,
                "discarded_zero_variance_groups": self.discarded_zero_variance_groups,
                "rollout_errors": self.rollout_errors,
                "offsets": dict(self.offsets),
            }
        }

    def note_offset(self, model: TrainableModel, step: int) -> None:
        """Before step `step` trains: the scenarios consumed so far (a resume at `step` skips them)."""
        self.offsets[str(step)] = self.scenario_offset
        for old in [
            k for k in self.offsets if int(k) < step - 8
        ]:  # only the last few steps can be resumed at
            del self.offsets[old]
        state = model.read_state() or {}
        state.setdefault(STATE_KEY, {})["offsets"] = dict(self.offsets)
        model.overwrite_state(state)


def saved_state(model: TrainableModel) -> dict[str, Any]:
    return dict((model.read_state() or {}).get(STATE_KEY, {}))


def last_logged_step(model: TrainableModel) -> int:
    """The newest train row in the model's local history (a run can die between its log and its state)."""
    from ..checkpoints import model_dir, read_history

    directory = model_dir(model.project, model.name, model.base_path)
    return max((int(r["step"]) for r in read_history(directory) if r.get("split") == "train"), default=-1)
