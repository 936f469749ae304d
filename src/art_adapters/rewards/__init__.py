"""Rewards: RULER, the relative LLM judge (per trajectory, or per turn), and helpers for reward functions."""

from .helpers import common_prefix_length, extract_json
from .ruler import (
    DEFAULT_RUBRIC,
    RulerError,
    TrajectoryScore,
    judge_messages,
    judge_scores,
    parse_scores,
    response_schema,
    ruler,
    ruler_score_group,
)
from .ruler_turns import TURN_RUBRIC, ruler_score_turns

__all__ = [
    "DEFAULT_RUBRIC",
    "RulerError",
    "TrajectoryScore",
    "common_prefix_length",
    "extract_json",
    "judge_messages",
    "judge_scores",
    "parse_scores",
    "response_schema",
    "ruler",
    "ruler_score_group",
    "ruler_score_turns",
    "TURN_RUBRIC",
]
