"""User-facing settings: one GRPO step (TrainConfig), SFT (SFTConfig) and the LoRA adapter (LoRAConfig).

Unknown fields are errors (a misspelt or unsupported ART setting is never silently dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    field_serializer,
    field_validator,
    model_validator,
)


class TrainConfig(BaseModel):
    """Settings of one `model.train(...)` step (ART's names where ART has them)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    learning_rate: float = Field(default=5e-6, gt=0)
    beta: float = Field(
        default=0.0,
        ge=0,
        validation_alias=AliasChoices("beta", "kl_penalty_coef"),
        description="KL coefficient to the base policy (adapter disabled); ART's kl_penalty_coef.",
    )
    kl_penalty_source: Literal["current_learner"] = Field(
        default="current_learner", description="ART's setting; the KL is always the current learner's."
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
    truncated_importance_sampling: float = Field(
        default=2.0,
        gt=0,
        description=(
            "The cap C of every token's behaviour weight min(pi_pre-step / pi_sampler, C): the one correction for "
            "the sampler's numerics and for staleness in async training (see training/loss.py); off_policy_cap "
            "is the same setting. None (ART's 'unset') means the default."
        ),
    )
    train_unkept_choices: bool = Field(
        default=False,
        description="n > 1: also train the choices the agent did not keep, under the trajectory's reward.",
    )
    train_on: dict[Literal["nodes", "agents", "roles"], list[str]] | None = Field(
        default=None,
        description=(
            'Train only the sampled tokens of these calls, by where they came from: {"nodes": [...]} (LangGraph '
            'node names or paths), {"agents": [...]} (Agents SDK agents), {"roles": [...]} (CallSource.role, '
            "else agent, else node); other calls stay in their sequences as context. None trains every call."
        ),
    )
    train_retokenized_text: bool = Field(
        default=False,
        description=(
            "Also train assistant turns that carry no sampled token ids, re-rendered by the chat template "
            "(their sampled_token_fraction is below 1; without this the trainer refuses such tokens)."
        ),
    )
    max_grad_norm: float = Field(default=1.0, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    micro_batch_tokens: int = Field(
        default=4096, gt=0, description="Token budget of one forward/backward pass."
    )
    grad_accumulation_sequences: None = Field(
        default=None,
        description=(
            "ART's sequences per optimizer update (ART takes several updates per step); only None here: a step "
            "is one optimizer update over all its sequences, so any other value is refused."
        ),
    )
    max_seq_len: int | None = Field(
        default=None,
        gt=0,
        description=(
            "The step's longest sequence, capped by the trainer's (None: the trainer's, `Trainer.max_seq_len`). "
            "A trajectory with a longer one is skipped whole and counted (`skipped_too_long`), never truncated."
        ),
    )
    max_token_drop: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description=(
            "The step guard (off by default): when one update lowers a trained token's probability by more than "
            "this (p before - p after, measured by one no-grad forward after the optimizer step), the update is "
            "scaled back along its line to delta/drop, then halved while still above, at most 3 tries (it can end "
            "a little above; metrics: step_scale, guarded, max_token_drop)."
        ),
    )
    measure_token_drop: bool = Field(
        default=False,
        description=(
            "Report max_token_drop without the guard too (one more no-grad forward per step); the guard always "
            "reports it."
        ),
    )
    behaviour_weight: Literal["truncated", "sign_aware"] = Field(
        default="truncated",
        description=(
            "The off-policy weight: 'truncated' = min(rho, cap) for every token (TIS); 'sign_aware' (TOPR) = "
            "clamp(rho, 1, cap) for a positive advantage (stale samples that would repair a collapse are never "
            "discounted), min(rho, cap) for a negative one."
        ),
    )
    advantage: Literal["trajectory", "turn", "gigpo"] = Field(
        default="trajectory",
        description=(
            "How rewards become each token's advantage: 'trajectory' (GRPO: one advantage per trajectory, its "
            "reward plus its calls' rewards); 'turn' (each call's discounted return-to-go against the group's "
            "per-turn baseline, free of length bias); 'gigpo' (GRPO's plus gigpo_weight times a step advantage "
            "among the group's calls from the same state). See training/turn_credit.py and docs/training.md."
        ),
    )
    gamma: float = Field(
        default=1.0, ge=0, le=1, description="Discount of later turns' rewards ('turn', 'gigpo')."
    )
    gigpo_weight: float = Field(
        default=1.0, ge=0, description="The weight of GiGPO's step advantage against the episode's."
    )
    state_key: Literal["prompt_ids"] | Callable[[Any], Hashable | None] = Field(
        default="prompt_ids",
        description=(
            "GiGPO's state of a call: 'prompt_ids' (its exact prompt token ids), or a function of the LLMCall "
            "returning a hashable key (None: no state). A function stays in this process: a RemoteBackend or "
            "the sharded trainer refuses it."
        ),
    )
    seed: int = 0

    @field_serializer("state_key", when_used="json")
    def _state_key_travels(self, value: object) -> str:
        if callable(value):
            raise ValueError(
                "TrainConfig.state_key is a function, which cannot be sent to another process (a RemoteBackend, "
                "the sharded trainer's ranks): use state_key='prompt_ids', or train with a LocalBackend"
            )
        return str(value)

    @model_validator(mode="after")
    def _credit_settings_used(self) -> TrainConfig:
        """gamma, gigpo_weight and state_key change only the estimators that use them: set to anything but their
        defaults for another, they are refused (a setting that would silently do nothing)."""
        self.check_credit_settings()
        return self

    def check_credit_settings(self) -> None:
        """The estimator settings' checks, again where they are used (`turn_credit.group_credit`): assignment and
        `model_copy(update=...)` skip validation, so `config.gamma = 0.5` under "trajectory" would do nothing."""
        if self.advantage not in ("trajectory", "turn", "gigpo"):
            raise ValueError(f"advantage is 'trajectory', 'turn' or 'gigpo', not {self.advantage!r}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"gamma is in [0, 1], not {self.gamma!r}")
        if not self.gigpo_weight >= 0.0:
            raise ValueError(f"gigpo_weight is >= 0, not {self.gigpo_weight!r}")
        fields = type(self).model_fields
        unused = {
            "trajectory": ["gamma", "gigpo_weight", "state_key"],
            "turn": ["gigpo_weight", "state_key"],
            "gigpo": [],
        }[self.advantage]
        named = [name for name in unused if getattr(self, name) != fields[name].default]
        if named:
            raise ValueError(
                f"{', '.join(named)} {'has' if len(named) == 1 else 'have'} no effect with "
                f"advantage={self.advantage!r} (gamma: 'turn' and 'gigpo'; gigpo_weight and state_key: 'gigpo')"
            )

    @model_validator(mode="before")
    @classmethod
    def _one_importance_cap(cls, data: object) -> object:
        """`truncated_importance_sampling` (ART's name) and `off_policy_cap` are one setting: given both, they must
        agree; None is ART's 'unset'."""
        if not isinstance(data, dict):
            return data
        names = [n for n in ("truncated_importance_sampling", "off_policy_cap") if n in data]
        values = {data[n] for n in names if data[n] is not None}
        if len(values) > 1:
            raise ValueError(
                "truncated_importance_sampling and off_policy_cap are one setting (the behaviour weight's cap); "
                f"got {sorted(values)}: give one"
            )
        data = {k: v for k, v in data.items() if k not in names}
        if values:
            data["truncated_importance_sampling"] = values.pop()
        return data

    @property
    def off_policy_cap(self) -> float:
        """The behaviour weight's cap (the same setting as `truncated_importance_sampling`)."""
        return self.truncated_importance_sampling

    @model_validator(mode="after")
    def _loss_defaults(self) -> TrainConfig:
        """Each loss's published defaults where the fields are unset (they stay unset, so another loss chosen
        later gets its own): CISPO has no lower clip (epsilon 1) and an upper clip of 4; GSPO clips its sequence
        ratio at 3e-4 / 4e-4 and normalises per sequence; GRPO clips at 0.2, per token.

        GSPO also takes its ratio against the trainer's pre-step policy, with the sampler's gap a capped weight
        (TIS at 2.0): measured on an H200 in bf16, the sampler/trainer gap alone put 53-97% of sequences outside
        3e-4 / 4e-4 and clipped about half the step's tokens before any update (bench/gpu_check.py)."""
        given = self.model_fields_set
        defaults: dict[str, object] = {}
        if self.loss == "cispo":
            defaults = {"epsilon": 1.0, "epsilon_high": 4.0}
        elif self.loss == "gspo":
            defaults = {"normalization": "sequence"}
            if "epsilon" not in given:  # a given epsilon alone is a symmetric clip, as for GRPO
                defaults.update(epsilon=3e-4, epsilon_high=4e-4)
        for key, value in defaults.items():
            if key not in given or (
                key == "epsilon_high" and self.epsilon_high is None and self.loss == "cispo"
            ):
                object.__setattr__(self, key, value)  # not through __setattr__: the field stays "unset"
        return self

    @field_validator("grad_accumulation_sequences", mode="before")
    @classmethod
    def _one_update_per_step(cls, value: object) -> None:
        if value is not None:
            from .compat import grad_accumulation_refusal  # compat imports this module

            raise ValueError(grad_accumulation_refusal("TrainConfig", value))
        return None

    @model_validator(mode="after")
    def _sign_aware_cap(self) -> TrainConfig:
        """The sign-aware weight never discounts a positive-advantage token (clamp(rho, 1, C)): a cap below 1
        would, so the pair is refused."""
        if self.behaviour_weight == "sign_aware" and self.truncated_importance_sampling < 1:
            raise ValueError(
                "behaviour_weight='sign_aware' keeps a positive-advantage token's weight at least 1, so its cap "
                f"truncated_importance_sampling (off_policy_cap) must be >= 1, not {self.truncated_importance_sampling}"
            )
        return self

    @model_validator(mode="after")
    def _check_train_on(self) -> TrainConfig:
        for key, names in (self.train_on or {}).items():
            if not names or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"train_on[{key!r}] must be a non-empty list of names, not {names!r}")
        return self

    @property
    def clip_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


class SFTConfig(BaseModel):
    """Settings of `model.train_sft(...)`: supervised steps on the assistant turns of trajectories.

    `learning_rate` may be a list, one rate per batch (ART's form); `batch_size="auto"` is 8."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float | list[float] = Field(default=2e-4)
    epochs: int = Field(default=1, ge=1)
    batch_size: int | Literal["auto"] = Field(default=8)
    max_grad_norm: float = Field(default=1.0, gt=0)
    max_seq_len: int | None = Field(
        default=None,
        gt=0,
        description="As TrainConfig.max_seq_len: None is the trainer's; longer trajectories are skipped, counted.",
    )
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> SFTConfig:
        # a schedule may reach 0 at its end (ART's linear decay does); a single rate must move the weights
        rates = self.learning_rate
        if (isinstance(rates, list) and (not rates or min(rates) < 0)) or (
            not isinstance(rates, list) and rates <= 0
        ):
            raise ValueError("learning_rate must be > 0 (or a non-empty list of rates >= 0)")
        if self.batch_size == "auto":
            self.batch_size = 8
        elif self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, not {self.batch_size}")
        return self

    def rate(self, batch: int, batches: int) -> float:
        """The learning rate of batch `batch` (0-based) of `batches`."""
        if not isinstance(self.learning_rate, list):
            return self.learning_rate
        if len(self.learning_rate) != batches:
            raise ValueError(
                f"learning_rate has {len(self.learning_rate)} rates but the run has {batches} batches"
            )
        return self.learning_rate[batch]


TrainSFTConfig = SFTConfig  # ART's name


class LoRAConfig(BaseModel):
    """The trained adapter. `modules_to_save=["lm_head"]` also trains the output head (needed by tiny models)."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=8, ge=1)
    alpha: int = Field(default=16, ge=1)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    modules_to_save: list[str] = Field(default_factory=list)


TRAINER_HEARTBEAT_S = (
    2.0  # how often a sharded trainer's leader tells the backend it is alive during a command
)


class ShardedTrainerOptions(BaseModel):
    """How a sharded trainer (`LocalBackend(trainer_processes=N)`) runs, beyond how many processes."""

    model_config = ConfigDict(extra="forbid")

    activation_checkpointing: bool = Field(
        True, description="Recompute each decoder layer's activations in backward instead of keeping them."
    )
    hsdp: bool = Field(
        False, description="Several hosts: shard within a host, replicate across hosts (FSDP2's HSDP mesh)."
    )
    collective_timeout_s: float = Field(
        60.0,
        gt=0,
        allow_inf_nan=False,
        description="How long a process waits in one collective for its peers before the group is declared "
        "broken (a hung or dead peer); far above the skew between processes inside a step.",
    )
    heartbeat_timeout_s: float = Field(
        30.0,
        allow_inf_nan=False,
        description="How long the backend waits without word from the trainer's leader (which beats every "
        f"{TRAINER_HEARTBEAT_S:g} s): at least {2 * TRAINER_HEARTBEAT_S:g} s.",
    )

    @field_validator("heartbeat_timeout_s")
    @classmethod
    def _beats_fit(cls, value: float) -> float:
        if not value >= 2 * TRAINER_HEARTBEAT_S:
            raise ValueError(
                f"heartbeat_timeout_s must be at least {2 * TRAINER_HEARTBEAT_S:g} s (twice the leader's "
                f"{TRAINER_HEARTBEAT_S:g} s heartbeat), not {value:g}: a shorter one kills healthy trainers"
            )
        return value
