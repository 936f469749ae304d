"""SQLite environment: a generated shop database file, questions answered from it, and a read-only query tool."""

from __future__ import annotations

import asyncio
import os
import random
import re
import shutil
import sqlite3
import tempfile
import time
import weakref
from pathlib import Path
from typing import Any

from .base import Scenario, Tool, ToolSet, exact_match_reward

SCHEMA = """
CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL, signup_year INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL, price REAL NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
                     order_date TEXT NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (order_id INTEGER NOT NULL REFERENCES orders(id),
                          product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL,
                          PRIMARY KEY (order_id, product_id));
"""

FIRST = [
    "Ada",
    "Ben",
    "Chloe",
    "Dev",
    "Emma",
    "Farid",
    "Grace",
    "Hugo",
    "Iris",
    "Jonas",
    "Kira",
    "Liam",
    "Mina",
    "Noah",
    "Olga",
    "Pablo",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wes",
    "Yara",
    "Zoe",
]
LAST = ["Okafor", "Lindqvist", "Moreau", "Patel", "Schmidt", "Tanaka", "Silva", "Novak", "Kim", "Haddad"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Tallinn"]
CATALOG = {
    "books": ["Atlas of Rivers", "Pocket Haiku", "Sea Stories", "The Clockmaker"],
    "garden": ["Copper Trowel", "Seed Tin", "Rain Barrel", "Hedge Shears"],
    "kitchen": ["Cast Iron Pan", "Tea Kettle", "Bread Knife", "Spice Rack", "Salad Bowl"],
    "toys": ["Kite", "Wooden Train", "Puzzle Cube", "Yo-yo"],
}
STATUSES = ["delivered", "delivered", "delivered", "shipped", "cancelled"]
YEARS = [2022, 2023, 2024]

# Reads only: anything else (writes, ATTACH, DETACH, PRAGMA writes, transactions) is denied by the authorizer.
_ALLOWED_ACTIONS = {
    sqlite3.SQLITE_SELECT,
    sqlite3.SQLITE_READ,
    sqlite3.SQLITE_FUNCTION,
    sqlite3.SQLITE_RECURSIVE,
}
_READ_PRAGMAS = {"table_info", "table_xinfo", "foreign_key_list", "index_list", "index_info", "table_list"}


def build_database(path: str | Path, seed: int = 0, customers: int = 40, orders: int = 160) -> Path:
    """Write the shop database to `path` (atomically); the same seed gives the same data."""
    rng = random.Random(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        with sqlite3.connect(tmp) as conn:
            conn.executescript(SCHEMA)
            names = rng.sample([f"{f} {s}" for f in FIRST for s in LAST], customers)
            conn.executemany(
                "INSERT INTO customers VALUES (?, ?, ?, ?)",
                [
                    (i + 1, n, rng.choice(CITIES), rng.choice([2019, 2020, 2021, 2022]))
                    for i, n in enumerate(names)
                ],
            )
            products = [(c, n) for c, ns in CATALOG.items() for n in ns]
            conn.executemany(
                "INSERT INTO products VALUES (?, ?, ?, ?)",
                [(i + 1, n, c, round(rng.uniform(3, 120), 2)) for i, (c, n) in enumerate(products)],
            )
            for order_id in range(1, orders + 1):
                date = f"{rng.choice(YEARS)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                conn.execute(
                    "INSERT INTO orders VALUES (?, ?, ?, ?)",
                    (order_id, rng.randint(1, customers), date, rng.choice(STATUSES)),
                )
                for product_id in rng.sample(range(1, len(products) + 1), rng.randint(1, 4)):
                    conn.execute(
                        "INSERT INTO order_items VALUES (?, ?, ?)", (order_id, product_id, rng.randint(1, 5))
                    )
        conn.close()
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


class ReadOnlyDatabase:
    """Runs one query at a time on a read-only connection; errors are text. Bounded in time, memory and disk: SQLite
    refuses values over `max_value_bytes` and results over `max_columns` columns; rows are formatted one at a time
    (each value cut at `max_value_chars`) and reading stops at `max_rows` rows or `max_chars` characters; the
    `timeout_s` deadline covers the query and the formatting. Sorts and temporary tables live in memory (no temp
    file on disk, where one ORDER BY wrote 440 MB in half a second), and a query is stopped once SQLite's working
    memory has grown by `max_work_bytes` since it began."""

    def __init__(
        self,
        path: str | Path,
        timeout_s: float = 1.0,
        max_rows: int = 50,
        max_chars: int = 4000,
        *,
        max_value_bytes: int = 64 * 1024,
        max_columns: int = 64,
        max_value_chars: int = 500,
        max_work_bytes: int = 48 * 2**20,
    ) -> None:
        self.path = Path(path).resolve()
        if not self.path.exists():
            raise FileNotFoundError(self.path)
        self.timeout_s = timeout_s
        self.max_rows = max_rows
        self.max_chars = max_chars
        self.max_value_bytes = max_value_bytes
        self.max_columns = max_columns
        self.max_value_chars = max_value_chars
        self.max_work_bytes = max_work_bytes

    def connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(f"{self.path.as_uri()}?mode=ro", uri=True, check_same_thread=False)
        conn.execute("PRAGMA query_only = ON")
        conn.execute("PRAGMA temp_store = MEMORY")  # sorts and temp tables never touch the disk...
        conn.execute(
            "PRAGMA cache_size = -256"
        )  # ...and a small page cache leaves the work budget to the query
        conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, self.max_value_bytes)
        conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, self.max_columns)
        conn.setlimit(sqlite3.SQLITE_LIMIT_SQL_LENGTH, 100_000)
        conn.set_authorizer(_authorize)
        return conn

    def query(self, sql: str) -> str:
        """The result as a small text table, or `Error: ...` (syntax, denied, timed out, too big)."""
        if not isinstance(sql, str) or not sql.strip():
            return "Error: empty query"
        deadline = time.monotonic() + self.timeout_s
        conn = self.connect()
        limit = _sqlite_memory_used() + self.max_work_bytes
        over: list[bool] = []

        def stop() -> int:
            if _sqlite_memory_used() > limit:
                over.append(True)
            return int(bool(over) or time.monotonic() > deadline)

        conn.set_progress_handler(stop, 1000)
        try:
            cursor = conn.execute(sql)
            columns = [d[0] for d in cursor.description or []]
            table = _Table(columns, self.max_rows, self.max_chars, self.max_value_chars)
            while not table.full:
                if time.monotonic() > deadline:
                    raise sqlite3.OperationalError("interrupted")
                row = cursor.fetchone()
                if row is None:
                    break
                table.add(row)
            else:
                table.more = cursor.fetchone() is not None
        except sqlite3.OperationalError as error:
            if over:
                return f"Error: query needed more than {self.max_work_bytes // 2**20} MiB of working memory and was stopped"
            if time.monotonic() > deadline or "interrupted" in str(error):
                return f"Error: query took longer than {self.timeout_s:g}s and was stopped"
            return f"Error: {error}"
        except (sqlite3.Error, sqlite3.Warning, OverflowError, MemoryError) as error:
            return f"Error: {error}"
        finally:
            conn.close()
        return table.text()

    async def aquery(self, sql: str) -> str:
        return await asyncio.to_thread(self.query, sql)

    def schema(self) -> str:
        conn = self.connect()
        try:
            rows = conn.execute("SELECT sql FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall()
        finally:
            conn.close()
        return "\n".join(re.sub(r"\s+", " ", r[0]).strip() + ";" for r in rows)


def _sqlite_memory_used() -> int:
    """Bytes SQLite holds in this process (its own counter; 0 where the library does not expose it)."""
    return int(_MEMORY_USED()) if _MEMORY_USED is not None else 0


def _memory_counter() -> Any:
    try:
        import _sqlite3
        import ctypes

        counter = ctypes.CDLL(_sqlite3.__file__).sqlite3_memory_used
    except (ImportError, OSError, AttributeError):  # pragma: no cover - a statically hidden SQLite
        return None
    counter.restype, counter.argtypes = ctypes.c_int64, []
    return counter


_MEMORY_USED = _memory_counter()


def _authorize(action: int, arg1: str | None, arg2: str | None, db: str | None, trigger: str | None) -> int:
    if action in _ALLOWED_ACTIONS:
        return sqlite3.SQLITE_OK
    if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() in _READ_PRAGMAS:
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


class _Table:
    """A result table built row by row, never holding more than its character budget."""

    def __init__(self, columns: list[str], max_rows: int, max_chars: int, max_value_chars: int) -> None:
        self.lines = [" | ".join(columns)]
        self.rows = 0
        self.chars = len(self.lines[0])
        self.max_rows, self.max_chars, self.max_value_chars = max_rows, max_chars, max_value_chars
        self.more = False
        self.truncated = False

    @property
    def full(self) -> bool:
        return self.rows >= self.max_rows or self.truncated

    def add(self, row: tuple[Any, ...]) -> None:
        line = " | ".join(self._value(v) for v in row)
        self.rows += 1
        if self.chars + len(line) + 1 > self.max_chars:
            line = line[: max(self.max_chars - self.chars - 1, 0)]
            self.truncated = True
        self.lines.append(line)
        self.chars += len(line) + 1

    def _value(self, value: Any) -> str:
        if value is None:
            return "NULL"
        if isinstance(value, bytes):
            text = f"<{len(value)} bytes>"
        else:
            text = str(value)
        return text if len(text) <= self.max_value_chars else text[: self.max_value_chars] + "..."

    def text(self) -> str:
        lines = list(self.lines)
        if self.truncated:
            lines.append("... (output truncated)")
        elif self.more:
            lines.append(f"... (more rows; only the first {self.max_rows} are shown)")
        if self.rows == 0:
            lines.append("(no rows)")
        return "\n".join(lines)


class SQLiteEnv:
    """The shop database as an environment: scenarios, the query tools, and an exact-match reward."""

    def __init__(
        self, path: str | Path | None = None, seed: int = 0, timeout_s: float = 1.0, max_rows: int = 50
    ):
        if path is None:  # a fresh private folder: a shared, predictable /tmp name could be planted by anyone
            folder = tempfile.mkdtemp(prefix="art-adapters-shop-")
            weakref.finalize(
                self, shutil.rmtree, folder, ignore_errors=True
            )  # removed with the env (or at exit)
            path = Path(folder) / f"shop-{seed}.sqlite"
        self.path = Path(path)
        if not self.path.exists():
            build_database(self.path, seed=seed)
        self.seed = seed
        self.db = ReadOnlyDatabase(self.path, timeout_s=timeout_s, max_rows=max_rows)

    def tools(self) -> ToolSet:
        async def run_query(sql: str) -> str:
            return await self.db.aquery(sql)

        def describe_schema() -> str:
            return self.db.schema()

        return ToolSet(
            [
                Tool(
                    "describe_schema",
                    "The CREATE TABLE statements of the database.",
                    {"type": "object", "properties": {}, "additionalProperties": False},
                    describe_schema,
                ),
                Tool(
                    "run_query",
                    "Run one read-only SQLite SELECT query and get the rows back.",
                    {
                        "type": "object",
                        "properties": {"sql": {"type": "string", "description": "One SQLite query."}},
                        "required": ["sql"],
                        "additionalProperties": False,
                    },
                    run_query,
                ),
            ]
        )

    def system_prompt(self) -> str:
        return (
            "You answer questions about a shop's SQLite database. Use the tools to look at the data. "
            "When you know the answer, reply with a final line `ANSWER: <answer>` (a number, a name, or a "
            "comma-separated list).\n\nSchema:\n" + self.db.schema()
        )

    def scenarios(self, split: str = "train", n: int | None = None) -> list[Scenario]:
        """Questions with answers computed from the database; `train` and `val` never share a question."""
        all_scenarios = generate_scenarios(self.path, seed=self.seed)
        chosen = [s for i, s in enumerate(all_scenarios) if (i % 5 == 4) == (split == "val")]
        return chosen[:n] if n is not None else chosen

    def reward(self, scenario: Scenario, answer: Any) -> float:
        return exact_match_reward(scenario, extract_answer(answer))


def extract_answer(text: Any) -> Any:
    """The part after the last `ANSWER:` of a reply (the whole reply when there is none)."""
    if not isinstance(text, str):
        return text
    match = re.findall(r"ANSWER:\s*(.+)", text, flags=re.IGNORECASE)
    value = match[-1].strip() if match else text.strip()
    if "," in value and not re.fullmatch(r"[\d,.$\s-]+", value):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def generate_scenarios(path: str | Path, seed: int = 0) -> list[Scenario]:
    """Questions from templates; each answer is what a query on the database returns (unambiguous ones only)."""
    conn = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True)
    rng = random.Random(seed + 1)
    out: list[Scenario] = []

    def one(sql: str, *args: Any) -> Any:
        return conn.execute(sql, args).fetchone()[0]

    def add(question: str, answer: Any, sql: str) -> None:
        out.append(
            Scenario(id=f"sql-{len(out):03d}", question=question, answer=answer, metadata={"sql": sql})
        )

    revenue = (
        "SELECT ROUND(SUM(i.quantity * p.price), 2) FROM orders o JOIN order_items i ON i.order_id = o.id "
        "JOIN products p ON p.id = i.product_id WHERE o.status = 'delivered' AND substr(o.order_date, 1, 4) = ?"
    )
    try:
        for city in CITIES:
            sql = "SELECT COUNT(*) FROM customers WHERE city = ?"
            add(f"How many customers live in {city}?", one(sql, city), sql)
        for year in YEARS:
            add(
                f"What was the total revenue (quantity times price) of delivered orders in {year}? "
                "Round to 2 decimals.",
                one(revenue, str(year)),
                revenue,
            )
        for category in CATALOG:
            sql = "SELECT MAX(price) FROM products WHERE category = ?"
            add(
                f"What is the price of the most expensive product in the {category} category?",
                one(sql, category),
                sql,
            )
            sql = (
                "SELECT SUM(i.quantity) FROM order_items i JOIN products p ON p.id = i.product_id "
                "WHERE p.category = ?"
            )
            add(f"How many units of {category} products were ordered in total?", one(sql, category), sql)
        names = [r[0] for r in conn.execute("SELECT name FROM customers ORDER BY id")]
        for name in rng.sample(names, 12):
            sql = "SELECT COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.name = ?"
            add(f"How many orders has {name} placed?", one(sql, name), sql)
        for status in ["cancelled", "shipped"]:
            sql = "SELECT COUNT(*) FROM orders WHERE status = ?"
            add(f"How many orders have the status '{status}'?", one(sql, status), sql)
        sql = (
            "SELECT p.name, SUM(i.quantity) AS units FROM order_items i JOIN products p ON p.id = i.product_id "
            "GROUP BY p.id ORDER BY units DESC LIMIT 2"
        )
        top = conn.execute(sql).fetchall()
        if len(top) == 2 and top[0][1] != top[1][1]:
            add("Which product has sold the most units?", top[0][0], sql)
        for city in CITIES[:3]:
            sql = (
                "SELECT DISTINCT p.category FROM orders o JOIN customers c ON c.id = o.customer_id "
                "JOIN order_items i ON i.order_id = o.id JOIN products p ON p.id = i.product_id "
                "WHERE c.city = ? AND o.status = 'cancelled' ORDER BY 1"
            )
            cats = [r[0] for r in conn.execute(sql, (city,))]
            if cats:
                add(
                    f"Which product categories appear in cancelled orders of customers from {city}? "
                    "List them comma-separated.",
                    cats,
                    sql,
                )
    finally:
        conn.close()
    return out
