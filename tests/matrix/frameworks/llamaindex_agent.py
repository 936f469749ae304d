"""LlamaIndex: a `FunctionAgent` workflow on `OpenAILike` (it streams every call)."""

from __future__ import annotations

from common import Endpoint, get_weather, question, react

NAME = "LlamaIndex (FunctionAgent)"
PACKAGES = ["llama-index-core", "llama-index-llms-openai-like"]
ENV = "frameworks"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "every call"
script = react


async def rollout(endpoint: Endpoint, k: int) -> str:
    from llama_index.core.agent.workflow import FunctionAgent
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(
        model=endpoint.model, api_base=endpoint.base_url, api_key=endpoint.api_key, is_chat_model=True,
        is_function_calling_model=True, context_window=8192,
    )  # fmt: skip
    agent = FunctionAgent(tools=[get_weather], llm=llm, system_prompt="You answer weather questions.")
    return str(await agent.run(question(k)))
