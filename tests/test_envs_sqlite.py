"""The SQLite environment: a deterministic database file, answers from it, and a query tool that cannot harm it."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

from art_adapters.envs import Scenario, SQLiteEnv, build_database, extract_answer
from art_adapters.envs.sqlite import ReadOnlyDatabase, generate_scenarios

HOSTILE = [
    "DROP TABLE customers",
    "DELETE FROM orders",
    "UPDATE products SET price = 0",
    "INSERT INTO orders VALUES (999, 1, '2024-01-01', 'delivered')",
    "ATTACH DATABASE 'evil.sqlite' AS evil",
    "CREATE TABLE evil (x)",
    "CREATE TEMP TABLE evil (x)",
    "PRAGMA journal_mode = WAL",
    "PRAGMA writable_schema = ON",
    "VACUUM",
    "BEGIN IMMEDIATE",
    "SELECT 1; DROP TABLE orders",
    "REINDEX",
    "SELECT load_extension('/tmp/x')",
]


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> SQLiteEnv:
    return SQLiteEnv(tmp_path_factory.mktemp("db") / "shop.sqlite", timeout_s=0.5, max_rows=10)


def test_database_is_deterministic(tmp_path: Path) -> None:
    a, b = build_database(tmp_path / "a.sqlite", seed=3), build_database(tmp_path / "b.sqlite", seed=3)
    assert digest(a) == digest(b)
    assert digest(build_database(tmp_path / "c.sqlite", seed=4)) != digest(a)
    assert [s.model_dump() for s in generate_scenarios(a, 3)] == [
        s.model_dump() for s in generate_scenarios(b, 3)
    ]


def test_scenarios_answers_come_from_the_database(env: SQLiteEnv) -> None:
    train, val = env.scenarios("train"), env.scenarios("val")
    assert len(train) >= 15 and len(val) >= 4
    assert not {s.question for s in train} & {s.question for s in val}
    for scenario in train + val:
        sql = scenario.metadata["sql"]
        assert sql.lstrip().upper().startswith("SELECT")
        assert scenario.answer is not None


def test_reward_is_verifiable(env: SQLiteEnv) -> None:
    s = Scenario(id="x", question="?", answer=12.5)
    assert env.reward(s, "Let me think.\nANSWER: 12.50") == 1.0
    assert env.reward(s, "ANSWER: 12.4") == 0.0
    assert env.reward(s, None) == 0.0
    listed = Scenario(id="y", question="?", answer=["books", "toys"])
    assert env.reward(listed, "ANSWER: Toys, books") == 1.0
    assert env.reward(listed, "ANSWER: toys") == 0.0
    assert env.reward(Scenario(id="z", question="?", answer="Ada Kim"), "answer: ada kim.") == 1.0
    assert extract_answer("ANSWER: 1,234") == "1,234"
    count = next(s for s in env.scenarios() if s.question.startswith("How many customers live in"))
    assert env.reward(count, f"ANSWER: {count.answer}") == 1.0


def test_queries_return_rows_with_a_cap(env: SQLiteEnv) -> None:
    out = env.db.query("SELECT id, name FROM customers ORDER BY id")
    lines = out.splitlines()
    assert lines[0] == "id | name" and len(lines) == 12 and "only the first 10" in lines[-1]
    assert env.db.query("SELECT name FROM customers WHERE id = -1").endswith("(no rows)")
    assert "cid | name" in env.db.query("PRAGMA table_info(orders)")


def test_hostile_queries_are_errors_and_leave_the_file_unchanged(env: SQLiteEnv) -> None:
    before = digest(env.path)
    for sql in HOSTILE + ["SELEC * FRM customers", "", "SELECT * FROM nowhere"]:
        out = env.db.query(sql)
        assert out.startswith("Error:"), (sql, out)
    assert digest(env.path) == before
    assert sorted(p.name for p in env.path.parent.iterdir()) == [env.path.name]
    assert "customers" in env.db.query("SELECT name FROM sqlite_master WHERE type = 'table'")


def test_runaway_queries_time_out(env: SQLiteEnv) -> None:
    for sql in [
        "SELECT count(*) FROM order_items a, order_items b, order_items c, order_items d",
        "WITH RECURSIVE r(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM r) SELECT count(*) FROM r",
    ]:
        start = time.monotonic()
        out = env.db.query(sql)
        assert time.monotonic() - start < 2.0
        assert out.startswith("Error: query took longer"), out
    assert env.db.query("SELECT length(randomblob(50000000))").startswith("Error:")


def test_tools_are_openai_schemas_and_safe_callables(env: SQLiteEnv) -> None:
    tools = env.tools()
    names = [s["function"]["name"] for s in tools.schemas]
    assert names == ["describe_schema", "run_query"]
    assert all(
        s["type"] == "function" and s["function"]["parameters"]["type"] == "object" for s in tools.schemas
    )

    async def calls() -> list[str]:
        return await asyncio.gather(
            tools.call("run_query", '{"sql": "SELECT COUNT(*) AS n FROM products"}'),
            tools.call("run_query", '{"sql": "DROP TABLE products"}'),
            tools.call("run_query", "{not json"),
            tools.call("run_query", '{"query": "SELECT 1"}'),
            tools.call("drop_everything", "{}"),
            tools.call("describe_schema", ""),
        )

    ok, denied, bad_json, wrong_args, unknown, schema = asyncio.run(calls())
    assert ok == "n\n17"
    assert denied.startswith("Error:") and bad_json.startswith("Error: arguments are not valid JSON")
    assert wrong_args.startswith("Error: wrong arguments for run_query")
    assert unknown.startswith("Error: unknown tool 'drop_everything'")
    assert schema.startswith("CREATE TABLE customers")


def test_read_only_even_when_the_file_is_writable(tmp_path: Path) -> None:
    path = build_database(tmp_path / "w.sqlite")
    db = ReadOnlyDatabase(path)
    conn = db.connect()
    try:
        with pytest.raises(Exception):  # noqa: B017 - any sqlite error: denied or read-only
            conn.execute("DELETE FROM orders")
    finally:
        conn.close()
    assert db.query("SELECT COUNT(*) FROM orders") == "COUNT(*)\n160"


UNBOUNDED = {
    "zeroblob": "SELECT zeroblob(999999), zeroblob(999999)",
    "columns": "SELECT " + ", ".join(f"{i} AS c{i}" for i in range(2000)),
    "huge_rows": (
        "WITH RECURSIVE r(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM r LIMIT 5000) "
        "SELECT printf('%.60000c', 'x') AS a, printf('%.60000c', 'y') AS b FROM r"
    ),
    # a sort of wide rows: SQLite spilled it to a temp file, 440 MB written in half a second
    "sort_spill": (
        "SELECT printf('%.3000c', 'x') || a.rowid || b.rowid AS s FROM order_items a, order_items b ORDER BY s DESC"
    ),
}
PEAK_RSS = """
import resource, sys
from art_adapters.envs.sqlite import ReadOnlyDatabase, build_database
db = ReadOnlyDatabase(build_database(sys.argv[1]))
def written():
    return int(dict(line.split(": ") for line in open("/proc/self/io").read().splitlines())["wchar"])
before = written()
out = db.query(sys.argv[2])
after = written()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
print(len(out), out[:60].replace("\\n", " "), out[-60:].replace("\\n", " "), "|", peak, (after - before) // 1024)
"""


def peak_rss_mib(tmp_path: Path, sql: str) -> tuple[int, int, str]:
    """(peak RSS in MiB, KiB written by the query, the start and end of its output), in a fresh process."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(tmp_path / "shop.sqlite"), sql],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    head, _, numbers = done.stdout.rpartition("|")
    rss, written = numbers.split()
    return int(rss), int(written), head


@pytest.mark.parametrize("name", sorted(UNBOUNDED))
def test_hostile_queries_are_bounded_in_memory_disk_and_output(tmp_path: Path, name: str) -> None:
    baseline, _, _ = peak_rss_mib(tmp_path, "SELECT 1")
    peak, written_kib, out = peak_rss_mib(tmp_path, UNBOUNDED[name])
    chars = int(out.split()[0])
    assert chars <= 4100, out  # max_chars (4000) plus the truncation note
    assert peak - baseline < 64, f"{name}: peak RSS grew {peak - baseline} MiB over a trivial query"
    assert written_kib < 1024, f"{name}: the query wrote {written_kib} KiB (temp files)"
    if name == "zeroblob":
        assert "too big" in out
    elif name == "columns":
        assert "too many columns" in out
    elif name == "sort_spill":
        assert "needed more than 48 MiB of working memory" in out
    else:
        assert "truncated" in out or "more rows" in out


async def test_a_sync_tool_bound_to_its_thread_keeps_working() -> None:
    """Sync tools run in a worker thread; one holding an object bound to the thread that made it (a sqlite3
    connection, as most tool code opens it) still answers, run where that object lives."""
    import sqlite3

    from art_adapters.envs.base import call_tool

    conn = sqlite3.connect(":memory:")  # check_same_thread=True: usable in this thread only
    conn.execute("CREATE TABLE t (x)")
    conn.execute("INSERT INTO t VALUES (42)")

    def lookup() -> str:
        return str(conn.execute("SELECT x FROM t").fetchone()[0])

    assert await call_tool({"lookup": lookup}, "lookup", "{}") == "42"
    assert await call_tool({"lookup": lookup}, "lookup", "{}") == "42"  # remembered: no failed try first


def test_default_database_lives_in_a_private_fresh_folder() -> None:
    a, b = SQLiteEnv(), SQLiteEnv()
    assert a.path != b.path and a.path.parent != b.path.parent
    assert a.path.parent.stat().st_mode & 0o077 == 0  # only its owner can reach it


async def test_a_slow_sync_tool_does_not_block_the_event_loop() -> None:
    import time

    from art_adapters.envs.base import call_tool

    def slow() -> str:
        time.sleep(0.5)
        return "done"

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)
            ticks += 1

    task = asyncio.ensure_future(ticker())
    assert await call_tool({"slow": slow}, "slow", "{}") == "done"
    task.cancel()
    assert ticks >= 10  # the loop kept running while the tool slept


def test_the_private_folder_goes_with_the_env() -> None:
    import gc

    env = SQLiteEnv()
    folder = env.path.parent
    assert folder.is_dir()
    del env
    gc.collect()
    assert not folder.exists()
