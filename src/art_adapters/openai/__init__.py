"""`art_adapters.openai`: capture plain OpenAI tool loops (ART-style `wrap_rollout`) and run their tools."""

from ..adapters.openai_tools import ToolLoopResult, run_tool_loop, wrap_rollout

__all__ = ["ToolLoopResult", "run_tool_loop", "wrap_rollout"]
