"""The value types the evaluation's statistics return: a mean with its interval, and per-scenario changes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Interval:
    """A mean with its confidence interval (low, high); NaN bounds when there are too few values to say."""

    mean: float
    low: float
    high: float

    def to_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "low": self.low, "high": self.high}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Interval:
        return cls(float(data["mean"]), float(data["low"]), float(data["high"]))


@dataclass(frozen=True)
class Changes:
    """Scenario ids that improved, stayed the same, or got worse from one target to another."""

    improved: list[str] = field(default_factory=list)
    same: list[str] = field(default_factory=list)
    worse: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, list[str]]:
        return {"improved": list(self.improved), "same": list(self.same), "worse": list(self.worse)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Changes:
        return cls(list(data["improved"]), list(data["same"]), list(data["worse"]))
