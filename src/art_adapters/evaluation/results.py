"""What an evaluation produced: every attempt, a summary per target (a step or a reference model) and the paired
comparisons between targets; JSON in and out, so a result file can be reported, resumed and compared later."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from .intervals import Changes, Interval


@dataclass
class Attempt:
    """One rollout of one scenario against one target."""

    target: str  # "step 0", "step 12", or a reference model's label
    scenario_id: str
    attempt: int  # 0 .. attempts - 1
    reward: float | None  # None when the attempt errored
    success: bool | None  # None when no threshold or boolean reward says what success is
    error: str | None  # "ExceptionType: message" when the rollout raised or returned something unusable
    messages: list[dict[str, Any]] = field(default_factory=list)  # the trajectory's messages, plain dicts
    seconds: float = 0.0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Attempt:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass
class TargetSummary:
    """One target's statistics over its scenarios."""

    target: str
    step: int | None  # None for a reference endpoint
    scenarios: int  # scenarios with at least one finished attempt
    errors: int  # attempts that errored
    reward: Interval  # bootstrap over the per-scenario mean rewards
    success_rate: float | None
    pass_at_k: dict[int, float] = field(default_factory=dict)  # every k <= attempts; empty without success

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["reward"] = self.reward.to_dict()
        out["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TargetSummary:
        return cls(
            target=data["target"],
            step=data["step"],
            scenarios=int(data["scenarios"]),
            errors=int(data["errors"]),
            reward=Interval.from_dict(data["reward"]),
            success_rate=data["success_rate"],
            pass_at_k={int(k): float(v) for k, v in data.get("pass_at_k", {}).items()},
        )


@dataclass
class Comparison:
    """Target b against target a on the scenarios both finished: diff = b - a, paired per scenario."""

    a: str
    b: str
    diff: Interval
    changes: Changes
    unpaired: list[str] = field(
        default_factory=list
    )  # scenarios one of them finished no attempt of: not in diff

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a,
            "b": self.b,
            "diff": self.diff.to_dict(),
            "changes": self.changes.to_dict(),
            "unpaired": list(self.unpaired),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Comparison:
        diff, changes = Interval.from_dict(data["diff"]), Changes.from_dict(data["changes"])
        return cls(data["a"], data["b"], diff, changes, list(data.get("unpaired", [])))


@dataclass
class EvalResult:
    """A whole evaluation: its settings, each target's summary, the comparisons and every attempt."""

    model: str
    project: str
    split: str
    attempts_per_scenario: int
    sampling: dict[str, Any]
    held_out: bool
    not_held_out_ids: list[str]
    targets: list[TargetSummary]
    comparisons: list[Comparison]
    attempts: list[Attempt]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "project": self.project,
            "split": self.split,
            "attempts_per_scenario": self.attempts_per_scenario,
            "sampling": dict(self.sampling),
            "held_out": self.held_out,
            "not_held_out_ids": list(self.not_held_out_ids),
            "targets": [t.to_dict() for t in self.targets],
            "comparisons": [c.to_dict() for c in self.comparisons],
            "attempts": [asdict(a) for a in self.attempts],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EvalResult:
        return cls(
            model=data["model"],
            project=data["project"],
            split=data["split"],
            attempts_per_scenario=int(data["attempts_per_scenario"]),
            sampling=dict(data["sampling"]),
            held_out=bool(data["held_out"]),
            not_held_out_ids=list(data["not_held_out_ids"]),
            targets=[TargetSummary.from_dict(t) for t in data["targets"]],
            comparisons=[Comparison.from_dict(c) for c in data["comparisons"]],
            attempts=[Attempt.from_dict(a) for a in data["attempts"]],
        )

    def target(self, label: str) -> TargetSummary:
        """The summary of one target, by its label ("step 0", "step 12", a reference's label)."""
        for summary in self.targets:
            if summary.target == label:
                return summary
        raise KeyError(f"no target {label!r} in this evaluation (have: {[t.target for t in self.targets]})")


def plain_messages(trajectory: Any) -> list[dict[str, Any]]:
    """The trajectory's messages as plain JSON-able dicts (choices as their messages)."""
    out: list[dict[str, Any]] = []
    for item in trajectory.messages_and_choices:
        if isinstance(item, dict):
            out.append(json.loads(json.dumps(item, default=str)))
            continue
        message = getattr(item, "message", None)
        dump = getattr(message if message is not None else item, "model_dump", None)
        out.append(dump(mode="json", exclude_none=True) if dump else {"content": str(item)})
    return out
