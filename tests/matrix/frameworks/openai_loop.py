"""A plain OpenAI SDK tool loop: the tool call in JSON, the answer streamed."""

from __future__ import annotations

import json

from common import Endpoint, get_weather, question, react

NAME = "OpenAI SDK (plain tool loop)"
PACKAGES = ["openai"]
ENV = "main"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "answer"
script = react

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


async def rollout(endpoint: Endpoint, k: int) -> str:
    import openai

    client = openai.AsyncOpenAI(base_url=endpoint.base_url, api_key=endpoint.api_key, max_retries=0)
    messages: list = [{"role": "user", "content": question(k)}]
    first = (
        await client.chat.completions.create(model=endpoint.model, messages=messages, tools=TOOLS)
    ).choices[0]
    messages.append(first.message.model_dump(exclude_none=True))
    for tool_call in first.message.tool_calls or []:
        result = get_weather(**json.loads(tool_call.function.arguments))
        messages.append({"role": "tool", "tool_call_id": tool_call.id, "content": result})
    stream = await client.chat.completions.create(
        model=endpoint.model, messages=messages, tools=TOOLS, stream=True
    )
    return "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
