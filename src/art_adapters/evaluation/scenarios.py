"""Evaluation scenarios with their ids: loaded from a .jsonl / .json file or taken as given, and checked (each has
an id, no id twice, at least one) before any rollout runs.

An id is a dict's `"id"` or an object's `.id` (a str or an int; ints become their decimal text). A scenario
without one is refused: an id derived from its content would change whenever the scenario is edited, and then
resumed attempts and held-out checks would silently stop matching."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any


class ScenarioError(ValueError):
    """The scenarios cannot be evaluated as given (the message names the scenario and the problem)."""


def scenario_id(scenario: Any, index: int) -> str:
    """The id of `scenario` (the `index`-th), or ScenarioError saying why it has none."""
    value = scenario.get("id") if isinstance(scenario, dict) else getattr(scenario, "id", None)
    if value is None:
        raise ScenarioError(
            f"scenario {index} has no id: give each scenario an 'id' (a dict key or an .id attribute), so that "
            "resumed attempts, held-out checks and per-scenario comparisons can name it"
        )
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise ScenarioError(f"scenario {index}'s id must be a str or an int, not {type(value).__name__}")
    text = str(value)
    if not text.strip():
        raise ScenarioError(f"scenario {index}'s id is empty")
    return text


def with_ids(scenarios: Iterable[Any]) -> list[tuple[str, Any]]:
    """(id, scenario) for each scenario, in order; refuses none, a missing id or an id used twice."""
    items = list(scenarios)
    if not items:
        raise ScenarioError("no scenarios to evaluate (the list or file is empty)")
    out: list[tuple[str, Any]] = []
    seen: dict[str, int] = {}
    for index, scenario in enumerate(items):
        sid = scenario_id(scenario, index)
        if sid in seen:
            raise ScenarioError(f"scenario id {sid!r} is used twice (scenarios {seen[sid]} and {index})")
        seen[sid] = index
        out.append((sid, scenario))
    return out


def known_ids(scenarios: Iterable[Any]) -> list[str]:
    """The ids of those scenarios that have a usable one (others are skipped: training needs none)."""
    out = []
    for index, scenario in enumerate(scenarios):
        try:
            out.append(scenario_id(scenario, index))
        except ScenarioError:
            continue
    return out


def check_train_ids(train_ids: Iterable[Any] | None) -> list[str] | None:
    """The training scenarios' ids as text; one string (a path, a single id) is refused, not read letter by letter."""
    if train_ids is None:
        return None
    if isinstance(train_ids, str | bytes | Path):
        raise ScenarioError(
            f"train_ids must be ids (a list, a set), not one string {str(train_ids)!r}: for a file, pass "
            "[id for id, _ in with_ids(load_scenarios(path))]"
        )
    return [str(i) for i in train_ids]


def load_scenarios(path: str | Path) -> list[Any]:
    """The scenarios in a `.jsonl` file (one JSON object a line; blank lines skipped) or a `.json` file (a list,
    or an object whose "scenarios" is one)."""
    path = Path(path)
    if not path.is_file():
        raise ScenarioError(f"scenario file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ScenarioError(f"scenario file {str(path)!r} is not UTF-8 ({error})") from None
    if path.suffix == ".jsonl":
        items = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                items.append(json.loads(line))
            except ValueError as error:
                raise ScenarioError(f"{path}:{number}: not JSON ({error})") from None
    elif path.suffix == ".json":
        try:
            data = json.loads(text) if text.strip() else []
        except ValueError as error:
            raise ScenarioError(f"{path}: not JSON ({error})") from None
        items = data.get("scenarios") if isinstance(data, dict) else data
        if not isinstance(items, list):
            raise ScenarioError(f"{path}: expected a JSON list of scenarios (or {{'scenarios': [...]}})")
    else:
        raise ScenarioError(f"scenario file {str(path)!r}: expected a .jsonl or .json file")
    if not items:
        raise ScenarioError(f"scenario file {str(path)!r} holds no scenarios")
    return items
