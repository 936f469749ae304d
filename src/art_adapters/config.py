"""User-facing settings: one GRPO step (TrainConfig), SFT (SFTConfig) and the LoRA adapter (LoRAConfig)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator


class TrainConfig(BaseModel):
    """Settings of one `model.train(...)` step (ART's names where ART has them)."""

    learning_rate: float = Field(default=5e-6, gt=0)
    beta: float = Field(
        default=0.0, ge=0, description="KL coefficient to the base policy (adapter disabled)."
    )
    epsilon: float = Field(default=0.2, gt=0, description="Lower clip range of the importance ratio.")
    epsilon_high: float | None = Field(
        default=None, description="Upper clip range (DAPO clip-higher); None = epsilon."
    )
    loss: Literal["grpo", "gspo", "cispo"] = "grpo"
    scale_rewards: bool = Field(
        default=True, description="Divide advantages by the group std; False is Dr. GRPO."
    )
    normalization: Literal["token", "sequence"] = "token"
    max_grad_norm: float = Field(default=1.0, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    micro_batch_tokens: int = Field(
        default=4096, gt=0, description="Token budget of one forward/backward pass."
    )
    max_seq_len: int = Field(
        default=2048, gt=0, description="Longer sequences are truncated (truncated tokens untrained)."
    )
    seed: int = 0

    @model_validator(mode="after")
    def _cispo_needs_upper_clip(self) -> TrainConfig:
        if self.loss == "cispo" and self.epsilon_high is None:
            self.epsilon_high = 4.0
        return self

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class SFTConfig(BaseModel):
    """Settings of `model.train_sft(...)`: supervised steps on the assistant turns of trajectories."""

    learning_rate: float = Field(default=2e-4, gt=0)
    epochs: int = Field(default=1, ge=1)
    batch_size: int = Field(default=8, ge=1)
    max_grad_norm: float = Field(default=1.0, gt=0)
    max_seq_len: int = Field(default=2048, gt=0)
    seed: int = 0


class LoRAConfig(BaseModel):
    """The trained adapter. `modules_to_save=["lm_head"]` also trains the output head (needed by tiny models)."""

    rank: int = Field(default=8, ge=1)
    alpha: int = Field(default=16, ge=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    modules_to_save: list[str] = Field(default_factory=list)
