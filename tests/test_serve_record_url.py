"""`serve --record`: the store URL (a database password, often) also from env ART_ADAPTERS_RECORD_URL or a file
(`--record-file`), said in `--help`; a password on the command line is warned about (argv shows in `ps`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from art_adapters.backend import launch

SECRET_URL = "postgresql://art:s3cret@db.internal/traffic"


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What `serve` would be called with (nothing starts)."""
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(launch, "serve", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.delenv(launch.RECORD_URL_ENV, raising=False)
    return calls


def test_the_url_comes_from_a_file_or_the_environment_without_a_warning(
    served: list[dict[str, Any]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture,
) -> None:
    secret = tmp_path / "record-url"
    secret.write_text(SECRET_URL + "\n")
    launch.serve_command(["--record-file", str(secret)])
    monkeypatch.setenv(launch.RECORD_URL_ENV, SECRET_URL)
    launch.serve_command([])
    assert [c["record"] for c in served] == [SECRET_URL, SECRET_URL]
    assert "password" not in capsys.readouterr().err
    monkeypatch.delenv(launch.RECORD_URL_ENV)
    launch.serve_command([])
    assert served[-1]["record"] is None  # no record mode unless asked


def test_a_password_on_the_command_line_is_warned_about(
    served: list[dict[str, Any]], capsys: pytest.CaptureFixture
) -> None:
    launch.serve_command(["--record", SECRET_URL])
    err = capsys.readouterr().err
    assert served[0]["record"] == SECRET_URL
    assert "holds a password" in err and launch.RECORD_URL_ENV in err and "s3cret" not in err
    launch.serve_command(["--record", "sqlite:///traffic.db"])
    assert "password" not in capsys.readouterr().err


def test_bad_record_options_fail_before_anything_starts(served: list[dict[str, Any]], tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(SystemExit, match="not both"):
        launch.serve_command(["--record", "sqlite:///a.db", "--record-file", str(empty)])
    with pytest.raises(SystemExit, match="is empty"):
        launch.serve_command(["--record-file", str(empty)])
    with pytest.raises(SystemExit, match="--record-file .*missing"):
        launch.serve_command(["--record-file", str(tmp_path / "missing")])
    assert served == []


def test_help_names_the_environment_variable_and_the_file(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        launch.serve_command(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--record-file PATH" in text and launch.RECORD_URL_ENV in text
