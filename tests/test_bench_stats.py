"""The benches' shared statistics (bench/async_pipeline.py): the paired 95 % t-interval every learning claim in the
docs rests on, and the result files' two shapes (a list of rows, or rows beside how they were made)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    import async_pipeline

    yield async_pipeline
    sys.modules.pop("async_pipeline", None)


@pytest.mark.parametrize(
    ("df", "quantile"),  # Student's t, 0.975, from published tables
    [(1, 12.7062), (5, 2.5706), (7, 2.3646), (30, 2.0423), (40, 2.0211), (60, 2.0003), (120, 1.9799)],
)
def test_t_quantile(bench: ModuleType, df: int, quantile: float) -> None:
    assert bench.t95(df) == pytest.approx(quantile, abs=2e-4)


def test_paired_interval_is_the_t_interval(bench: ModuleType) -> None:
    diffs = [0.01, -0.02, 0.03, 0.0, 0.05, -0.01, 0.02, 0.04]
    mean, low, high = bench.paired_interval(diffs)
    half = 2.3646 * statistics.stdev(diffs) / 8**0.5
    assert (mean, low, high) == pytest.approx((0.015, 0.015 - half, 0.015 + half))
    assert bench.paired_interval([0.1])[1] != bench.paired_interval([0.1])[1]  # one seed: no interval (NaN)


def test_summarize_reads_both_file_shapes(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    rows = json.loads((ROOT / "bench/results/async-guard-d07.json").read_text())
    assert isinstance(rows, dict) and rows["commit"] and len(rows["rows"]) == 32
    args = argparse.Namespace(collapse_below=0.25)
    for saved in (
        rows,
        rows["rows"],
        json.loads((ROOT / "bench/results/async-guard-seed0.json").read_text()),
    ):
        bench.summarize(bench.rows_of(saved), args)
    out = capsys.readouterr().out
    assert "+0.011 [-0.014, +0.036]" in out  # the figure docs/async.md gives for two steps off-policy


def test_append_rows_keeps_either_shape_and_leaves_no_partial_file(bench: ModuleType, tmp_path: Path) -> None:
    listed, described = tmp_path / "list.json", tmp_path / "described.json"
    bench.append_rows(listed, [{"seed": 0}])
    bench.append_rows(listed, [{"seed": 1}])
    described.write_text(json.dumps({"commit": "abc", "rows": [{"seed": 0}]}))
    bench.append_rows(described, [{"seed": 1}])
    assert json.loads(listed.read_text()) == [{"seed": 0}, {"seed": 1}]
    assert json.loads(described.read_text()) == {"commit": "abc", "rows": [{"seed": 0}, {"seed": 1}]}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["described.json", "list.json"]
