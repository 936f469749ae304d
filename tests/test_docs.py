"""The documentation's Python blocks run: every ```python block in README.md and docs/ is executed, a page's blocks
in order in one namespace (top-level `await` allowed), in a fresh working directory.

A block that cannot run here says so on the line before it, and is skipped with that reason, visibly:

    <!-- test: skip: needs a GPU -->

Blocks that only include a file (`--8<-- "path"`, shown by the docs site) are skipped too: that file runs where it
lives (the framework matrix). `mkdocs build --strict` (`make docs`) checks the links and the API reference.
"""

from __future__ import annotations

import ast
import asyncio
import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)\s*(?P<info>[^\n`]*)$")
SKIP = re.compile(r"^\s*<!--\s*test:\s*skip:\s*(?P<reason>.+?)\s*-->\s*$")
INCLUDE = "--8<--"


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str | None

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def python_blocks(page: Path) -> list[Block]:
    """The page's ```python blocks, each with the skip reason the line before it gives (if any)."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    k = 0
    while k < len(lines):
        opening = FENCE.match(lines[k])
        if opening is None:
            k += 1
            continue
        fence, info = opening["fence"], opening["info"].strip().split()
        end = k + 1
        while end < len(lines) and not lines[end].strip().startswith(fence):
            end += 1
        if end == len(lines):
            raise AssertionError(f"{page.relative_to(ROOT)}:{k + 1}: a code block is never closed")
        if info and info[0] in ("python", "py"):
            indent = len(opening["indent"])
            code = "\n".join(line[indent:] for line in lines[k + 1 : end])
            before = SKIP.match(lines[k - 1]) if k > 0 else None
            reason = before["reason"] if before else None
            if reason is None and INCLUDE in code:
                reason = "includes a file (run where it lives)"
            blocks.append(Block(page, k + 1, code, reason))
        k = end + 1
    return blocks


BLOCKS = [block for page in PAGES for block in python_blocks(page)]
NAMESPACES: dict[Path, dict[str, Any]] = {}


def run_block(block: Block) -> None:
    namespace = NAMESPACES.setdefault(block.page, {"__name__": f"docs_{block.page.stem}"})
    code = compile(block.code, block.id, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(code, namespace)  # noqa: S307 - the project's own documentation
    if inspect.iscoroutine(result):
        asyncio.run(asyncio.wait_for(result, timeout=120))


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_docs_block(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.skip is not None:
        pytest.skip(f"{block.id}: {block.skip}")
    monkeypatch.chdir(tmp_path)
    run_block(block)


def test_the_extractor_finds_and_runs_blocks(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n```python\nx = 1\n```\n\n<!-- test: skip: needs a GPU -->\n```python\nraise SystemExit\n```\n\n"
        "```python\nimport asyncio\nawait asyncio.sleep(0)\nassert x == 1\ny = x + 1\n```\n\n"
        "```bash\nmake demo\n```\n\n```python\nassert y == 3\n```\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        blocks = python_blocks(page)
        assert [(b.line, b.skip) for b in blocks] == [(3, None), (8, "needs a GPU"), (12, None), (23, None)]
        run_block(blocks[0])
        run_block(blocks[2])  # top-level await, the page's namespace carried over
        with pytest.raises(AssertionError):
            run_block(blocks[3])  # a failing block fails its test
    finally:
        ROOT = saved
        NAMESPACES.pop(page, None)


def test_every_page_has_been_looked_at() -> None:
    assert len(PAGES) > 20 and len(BLOCKS) > 20
    runnable = [b for b in BLOCKS if b.skip is None]
    assert len(runnable) >= 5, [b.id for b in runnable]
