"""Attacks on per-agent adapter names (issue 39): a key that is already a valid name but looks like another key's
sanitized name, and a key equal to the reserved name the shared adapter's metrics use ("shared"), must not share an
adapter (or its metrics) with anything else."""

from __future__ import annotations

import hashlib
import re

import pytest

import art_adapters as art
from art_adapters.agent_adapters import SHARED, adapter_name

pytest.importorskip("torch")
from art_adapters.training.per_agent import metric_name  # noqa: E402


def test_a_valid_key_never_takes_another_keys_sanitized_name() -> None:
    spaced = "Research Agent"
    sanitized = adapter_name(spaced)
    assert sanitized != spaced and re.fullmatch(r"Research_Agent-[0-9a-f]{8}", sanitized)
    # a key that is a valid name as it is, spelled like that sanitized name
    lookalike = "Research_Agent-" + hashlib.blake2b(spaced.encode(), digest_size=4).hexdigest()
    assert lookalike == sanitized
    assert adapter_name(lookalike) != sanitized  # else both agents would train and serve one adapter
    assert adapter_name(lookalike) == adapter_name(lookalike)  # stable
    # agents=None: two keys, two adapters
    per = art.PerAgent(by="role")
    adapters = {per.adapter_of(art.CallSource(role=k)) for k in (spaced, lookalike)}
    assert len(adapters) == 2
    # a fixed list of both is accepted (they are two adapters)
    assert len(set(art.PerAgent(by="role", agents=[spaced, lookalike]).listed())) == 2
    # ordinary valid keys are still kept as they are
    for key in ("planner", "ok-name_1", "worker-3", "a" * 48, "x-deadbeefx"):
        assert adapter_name(key) == key


def test_an_agent_named_like_the_shared_adapters_metrics_keeps_its_own() -> None:
    name = adapter_name("shared")
    assert metric_name(name) != metric_name(SHARED)  # agent/shared/... would mix two adapters' numbers
    assert art.PerAgent(by="role").adapter_of(art.CallSource(role="shared")) == name
    assert adapter_name("shared") == name and name != SHARED
