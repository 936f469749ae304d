"""ART's `art.pipeline_tuner` face: `PipelineRuntimeConfig`, the pipeline's runtime settings as ART main names them
(`from art import PipelineRuntimeConfig` works too). Autotuning is not offered: its config is refused by name."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class PipelineRuntimeConfig(BaseModel):
    """ART's pipeline runtime settings (`PipelineTrainer(..., pipeline=PipelineRuntimeConfig(...))`)."""

    model_config = ConfigDict(extra="forbid")

    num_rollout_workers: int = Field(16, ge=1)
    min_batch_size: int = Field(4, ge=1)
    max_batch_size: int | None = Field(None, ge=1, description="Default: min_batch_size (ART main).")
    max_steps_off_policy: int | None = Field(4, ge=0, description="None (unbounded) is not supported here.")
    queue_maxsize: int | None = Field(None, ge=1)
    score_reference_groups_per_step: float | None = Field(None, gt=0.0)
    score_reference_rollouts_per_group: float | None = Field(None, gt=0.0)

    @model_validator(mode="after")
    def _batch_bounds(self) -> PipelineRuntimeConfig:
        if self.max_batch_size is not None and self.max_batch_size < self.min_batch_size:
            raise ValueError("max_batch_size must be >= min_batch_size")
        return self


__all__ = ["PipelineRuntimeConfig"]
