"""ART's tokenized views of trajectories (`Trajectory.tokenize()`, ART PR #773): per-token ids, logprobs and
`TokenFlag`s. The data contract names them; the tokenization itself is provided by the package (training layer)."""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntFlag
from typing import Any, Generic, Protocol, TypeVar

from pydantic import BaseModel, ConfigDict, model_validator


class TokenFlag(IntFlag):
    """Independent facts about one token (ART's names; members combine)."""

    EXACT = (
        1 << 0
    )  # the id came from the inference engine (its prompt or sampled ids), not a client-side render
    SAMPLED = 1 << 1  # the token belongs to a model-sampled response, not to its prompt


class TokenizedHistory(BaseModel):
    """One token sequence: a history's ids, the sampled logprobs (NaN where none) and each token's flags."""

    model_config = ConfigDict(ser_json_inf_nan="strings")

    model: str
    token_ids: list[int]
    logprobs: list[float]
    flags: list[TokenFlag]

    @property
    def tokens(self) -> list[int]:
        """ART's later name for `token_ids`."""
        return self.token_ids

    @model_validator(mode="after")
    def _same_lengths(self) -> TokenizedHistory:
        if not len(self.token_ids) == len(self.logprobs) == len(self.flags):
            raise ValueError("Tokenized history fields differ in length")
        return self


class TokenizedTrajectory(TokenizedHistory):
    reward: float
    metrics: dict[str, float | int | bool]
    metadata: dict[str, Any]


class TokenizedMultiHistoryTrajectory(BaseModel):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    histories: list[TokenizedHistory]
    reward: float
    metrics: dict[str, float | int | bool]
    metadata: dict[str, Any]


TokenizedTrajectoryT = TypeVar("TokenizedTrajectoryT", TokenizedTrajectory, TokenizedMultiHistoryTrajectory)


class TokenizedTrajectoryGroup(BaseModel, Generic[TokenizedTrajectoryT]):
    model_config = ConfigDict(ser_json_inf_nan="strings")

    trajectories: list[TokenizedTrajectoryT]
    metrics: dict[str, float | int | bool]
    metadata: dict[str, Any]


class HistoryTokenizer(Protocol):
    """Tokenize one source (a Trajectory or a History) into its token sequences (see training/art_tokenize.py)."""

    def __call__(
        self,
        source: Any,
        *,
        reconcile_text_equivalent_tokenizations: bool,
        model: str | None,
        base_model: str | None,
        tokenizer: Any,
        chat_template: str | None,
        chat_template_kwargs: Mapping[str, object] | None,
    ) -> list[TokenizedHistory]: ...


_tokenizers: list[HistoryTokenizer] = []


def provide_history_tokenizer(tokenize: HistoryTokenizer) -> None:
    """Give `Trajectory.tokenize()` its implementation (called once, by `art_adapters/__init__.py`)."""
    _tokenizers[:] = [tokenize]


def history_tokenizer() -> HistoryTokenizer:
    if not _tokenizers:
        raise RuntimeError("tokenization is provided by the art_adapters package: import art_adapters first")
    return _tokenizers[0]


def tokenize_trajectory(
    trajectory: Any, *, multi_history: bool, **options: Any
) -> TokenizedTrajectory | TokenizedMultiHistoryTrajectory:
    """`Trajectory.tokenize()`: its one history (`multi_history=False`: a trajectory that splits into several
    raises, naming them) or all of them, with its reward, metrics and metadata."""
    histories = history_tokenizer()(trajectory, **options)
    common = {
        "reward": trajectory.reward,
        "metrics": dict(trajectory.metrics),
        "metadata": dict(trajectory.metadata),
    }
    if multi_history:
        return TokenizedMultiHistoryTrajectory(histories=histories, **common)
    if len(histories) != 1:
        raise ValueError(
            f"the trajectory tokenizes into {len(histories)} histories (a later prompt does not extend the tokens "
            "sampled before it, or it has additional histories): pass multi_history=True for all of them, or "
            "reconcile_text_equivalent_tokenizations=True where the prompts differ only in how the same text is "
            "tokenized"
        )
    return TokenizedTrajectory(**dict(histories[0]), **common)


def tokenize_group(group: Any, *, multi_history: bool, **options: Any) -> TokenizedTrajectoryGroup[Any]:
    """`TrajectoryGroup.tokenize()`: each trajectory's, with the group's metrics and metadata."""
    return TokenizedTrajectoryGroup(
        trajectories=[
            tokenize_trajectory(t, multi_history=multi_history, **options) for t in group.trajectories
        ],
        metrics=dict(group.metrics),
        metadata=dict(group.metadata),
    )
