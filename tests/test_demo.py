"""`art-adapters demo` end to end, shortened: its own vLLM server, warm start, GRPO steps, the result line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.train]
RESULT = re.compile(
    r"^demo result: success_start=(?P<start>\d+\.\d+) success_end=(?P<end>\d+\.\d+) "
    r"steps=(?P<steps>\d+) seconds=(?P<seconds>\d+\.\d+)$"
)
STEPS = 12


def test_demo_learns_and_ends_with_the_result_line(tmp_path: Path) -> None:
    command = [str(Path(sys.executable).parent / "art-adapters"), "demo", "--steps", str(STEPS)]
    command += ["--path", str(tmp_path / "art"), "--out", str(tmp_path / "reward.png")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    lines = done.stdout.strip().splitlines()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    match = RESULT.match(lines[-1])
    assert match, lines[-5:]
    assert int(match["steps"]) == STEPS
    assert (tmp_path / "reward.png").stat().st_size > 0
    history = tmp_path / "art" / "demo" / "models" / "tool-agent" / "history.jsonl"
    splits = Counter(json.loads(line)["split"] for line in history.read_text().splitlines())
    assert splits == {"sft": 1, "train": STEPS, "val": 2}  # the warm start, the steps, 2 evaluations
    assert float(match["end"]) >= float(match["start"]) + 0.15, lines[-1]  # the short run still learns
    # where the time went, by phase, just before the result
    assert lines[-2].startswith("time: tiny model") and "GRPO steps" in lines[-2], lines[-2]
    # only our own lines: no library's import notes (torchao's extensions, torch's pytree deprecation), and no
    # progress bar redrawn into a log (stderr is not a terminal here)
    assert done.stderr.strip() == "", done.stderr[-3000:]
