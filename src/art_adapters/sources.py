"""Where an LLM call came from (`CallSource`): framework, graph node, agent, role, run ids; and `art.role(...)`.

Read from the agent framework's own context when the call is captured (see `capture/frameworks.py`); tokenizing,
masking (`TrainConfig.train_on`), per-role rewards and tracing consume it. Nothing re-derives it from text.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Literal

from pydantic import BaseModel, Field

SplitBy = Literal["node", "agent", "role"]

_ROLE: ContextVar[str | None] = ContextVar("art_adapters_role", default=None)


class CallSource(BaseModel):
    """The origin of one captured call.

    `framework`: "langgraph", "langchain", "openai_agents" or "openai" (a plain client). `node`: the LangGraph
    node that made the call, `checkpoint_ns` its checkpoint namespace (`"outer:<task>|inner:<task>"` inside a
    subgraph), so `node_path` ("outer/inner") tells subgraph calls apart. `agent`: the Agents SDK agent;
    `agent_path` the agents it runs under (agents used as tools), outermost first, ending with `agent`;
    `handoffs` the agents that held the same run before it. `trace_id`: the Agents SDK trace the call ran in
    (one `Runner.run`, or the user's `trace(...)` around several; a local id when tracing is disabled).
    `run_id` / `parent_run_id`: the framework's ids of the call and of the step that made it. `role`: set by the
    user (`art.role("planner")` or LangChain metadata `{"role": "planner"}`). `tags`: LangChain tags.
    """

    framework: str = "openai"
    node: str | None = None
    checkpoint_ns: str | None = None
    agent: str | None = None
    agent_path: list[str] = Field(default_factory=list)
    handoffs: list[str] = Field(default_factory=list)
    trace_id: str | None = None
    run_id: str | None = None
    parent_run_id: str | None = None
    role: str | None = None
    tags: list[str] = Field(default_factory=list)

    @property
    def node_path(self) -> str | None:
        """The node with the nodes of its enclosing graphs, outermost first ("research/llm"); None outside a graph."""
        if self.node is None:
            return None
        if not self.checkpoint_ns:
            return self.node
        names = [part.split(":", 1)[0] for part in self.checkpoint_ns.split("|") if part]
        return "/".join(names) if names and names[-1] == self.node else "/".join([*names, self.node])

    def key(self, by: SplitBy) -> str | None:
        """This call's group under `by`: the node path, the agent, or the role (the explicit role, else the agent,
        else the node path). None when the framework gave nothing to group by."""
        if by == "node":
            return self.node_path
        if by == "agent":
            return self.agent
        if by == "role":
            return self.role or self.agent or self.node_path
        raise ValueError(f"split by 'node', 'agent' or 'role', not {by!r}")

    def role_names(self) -> tuple[str, ...]:
        """The names this call answers to as a role, most specific first: its explicit role, else its agent, else
        its node path and node name (a subgraph's `research/planner` answers to `planner` too)."""
        if self.role:
            return (self.role,)
        if self.agent:
            return (self.agent,)
        if self.node is None:
            return ()
        path = self.node_path or self.node
        return (path,) if path == self.node else (path, self.node)

    def matches(self, by: SplitBy, names: set[str]) -> bool:
        """Whether this call is one of `names` under `by` (a node matches by name or by node path; a role as
        `role_names` says). `TrainConfig.train_on` and `Trajectory.rewards_by_role` both match this way."""
        if by == "node":
            return bool({self.node, self.node_path} & names)
        if by == "role":
            return any(name in names for name in self.role_names())
        return self.key(by) in names


def current_role() -> str | None:
    """The role set by the innermost `art.role(...)` in this context, if any."""
    return _ROLE.get()


@contextmanager
def role(name: str) -> Iterator[str]:
    """Every call captured inside gets `source.role = name` (tasks started inside inherit it):

    with art.role("planner"):
        plan = await client.chat.completions.create(...)
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a role is a non-empty string, not {name!r}")
    token = _ROLE.set(name)
    try:
        yield name
    finally:
        _ROLE.reset(token)
