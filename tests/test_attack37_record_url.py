"""Attack on `serve --record-file` / ART_ADAPTERS_RECORD_URL (issue 37 §3): the URL is kept off argv to hide its
password, so an error about it must not print the password either (an SQLAlchemy-style `postgresql+psycopg://` or
a typo'd scheme is refused naming the URL, its password masked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from art_adapters.store import open_store

SECRET = "s3cret-pw"


@pytest.mark.parametrize(
    "url",
    [
        f"postgresql+psycopg://alice:{SECRET}@db.internal:5432/runs",
        f"mysql://alice:{SECRET}@db.internal/runs",
        f"postgresq://alice:{SECRET}@db.internal/runs",
    ],
)
def test_a_refused_store_url_never_shows_its_password(url: str) -> None:
    with pytest.raises(ValueError) as error:
        open_store(url)
    assert SECRET not in str(error.value) and "alice:***@db.internal" in str(error.value)


def test_serve_with_a_bad_record_file_keeps_the_password_off_stderr(tmp_path: Path) -> None:
    record = tmp_path / "record-url"
    record.write_text(f"postgresql+psycopg://alice:{SECRET}@127.0.0.1:1/runs\n")
    record.chmod(0o600)
    script = (
        "from art_adapters.backend.launch import record_url, _recorder\n"
        f"_recorder(record_url(None, {str(record)!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "a store URL is" in done.stderr
    assert SECRET not in done.stderr + done.stdout
