"""`art-adapters trainer-worker --adapters=...` on another host: what node 0 logs is a JSON list of adapter names.
A flag typed by hand (commas, a bare string, a name that is no adapter name) is a clear usage error before
anything starts, not a traceback or a list of single characters that the rendezvous then refuses as a mismatch."""

from __future__ import annotations

import pytest

from art_adapters.training.launcher import trainer_worker_command
from art_adapters.training.rendezvous import TOKEN_ENV

BASE = ["--nodes=2", "--node-rank=1", "--master=hostA:29400", "--base-model=/nowhere"]


@pytest.mark.parametrize("flag", ["a,b", '"ab"', "null", '["a", 3]', '["a.b"]', '["shared"]'])
def test_a_bad_adapters_flag_is_a_usage_error_naming_it(
    flag: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exited:
        trainer_worker_command([*BASE, f"--adapters={flag}"])
    assert exited.value.code == 2
    assert "--adapters" in capsys.readouterr().err


def test_the_flag_node_0_logs_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit, match=TOKEN_ENV):  # past the flags: the missing token is the next refusal
        trainer_worker_command([*BASE, '--adapters=["a", "Research_Agent-0a1b2c3d"]'])
