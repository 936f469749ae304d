"""The async pipeline's settings (ART's PipelineTrainer knobs, named as ours) and what each step reports."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class PipelineConfig(BaseModel):
    """How the pipeline overlaps rollouts and training."""

    model_config = ConfigDict(extra="forbid")

    rollout_workers: int = Field(4, ge=1, description="Groups being rolled out at once.")
    groups_per_step: int = Field(
        4, ge=1, description="A step waits for this many groups (ART: min_batch_size)."
    )
    max_groups_per_step: int | None = Field(
        None, ge=1, description="...and takes up to this many already waiting (default: groups_per_step)."
    )
    max_steps_off_policy: int = Field(
        1, ge=0, description="How far behind the trained step a sampling policy may be; 0 is synchronous."
    )
    queue_size: int | None = Field(
        None,
        ge=1,
        description="Finished groups waiting for the trainer (default: enough for the bound above).",
    )
    max_steps: int | None = Field(
        None, ge=0, description="Steps to train in this run (None: until the scenarios end)."
    )
    eval_every_n_steps: int = Field(0, ge=0, description="Evaluate every N steps (0: never).")
    eval_at_start: bool = Field(False, description="Also evaluate the step the run starts from.")
    eval_timeout_s: float | None = Field(
        1800.0,
        gt=0,
        description="An evaluation still running after this is cancelled and logged as failed (None: no bound).",
    )
    max_failed_groups: int = Field(
        16,
        ge=1,
        description="Consecutive rollouts with no trajectory (raised, returned none) before the run stops on their error.",
    )
    max_zero_variance_groups: int | None = Field(
        None,
        ge=1,
        description=(
            "Stop once this many groups in a row between two steps had equal rewards (a collapsed policy; ART's "
            "failsafe, discard_queue_multiplier * min_batch_size). None: never."
        ),
    )

    @property
    def batch_cap(self) -> int:
        return max(self.max_groups_per_step or self.groups_per_step, self.groups_per_step)

    @property
    def queue_cap(self) -> int:
        return self.queue_size or max(1, self.max_steps_off_policy + 1) * self.batch_cap


class StepReport(BaseModel):
    """What one pipeline step trained on and how the pipeline spent its time (also written to history.jsonl)."""

    step: int
    groups: int
    metrics: dict[str, float]
