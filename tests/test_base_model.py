"""Base models are local folders or hub ids; anything else is a clear error before a server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from art_adapters.inference.config import validate_model_dir


def test_a_local_folder_is_used_as_is(tiny_model: Path) -> None:
    assert validate_model_dir(tiny_model) == tiny_model.resolve()


def test_a_hub_id_that_cannot_be_fetched_names_the_id(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # no hub here: the id must fail fast with a clear message
    with pytest.raises(
        ValueError, match="'no-such-org/no-such-model' is not a local folder and could not be fetched"
    ):
        validate_model_dir("no-such-org/no-such-model")


def test_a_missing_path_and_a_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        validate_model_dir(tmp_path / "missing")
    with pytest.raises(ValueError, match="no config.json"):
        validate_model_dir(tmp_path)
