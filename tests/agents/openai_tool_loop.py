"""A plain OpenAI tool loop in a process of its own, knowing nothing of art_adapters: what a sandboxed agent or
another team's service looks like to the recording endpoint.

    python openai_tool_loop.py BASE_URL MODEL [--stream] [--role ROLE]
"""

from __future__ import annotations

import argparse
import json

import openai

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base_url")
    parser.add_argument("model")
    parser.add_argument("--stream", action="store_true")
    parser.add_argument("--role")
    args = parser.parse_args()
    headers = {"x-art-role": args.role} if args.role else None
    client = openai.OpenAI(
        base_url=args.base_url, api_key="not-needed", max_retries=0, default_headers=headers
    )
    messages: list[dict] = [{"role": "user", "content": "Weather in Oslo?"}]
    for _ in range(4):
        if args.stream:
            stream = client.chat.completions.create(
                model=args.model,
                messages=messages,
                tools=TOOLS,
                stream=True,
            )
            content, calls = "", {}
            for chunk in stream:
                delta = chunk.choices[0].delta if chunk.choices else None
                content += (delta.content or "") if delta else ""
                for call in (delta.tool_calls or []) if delta else []:
                    slot = calls.setdefault(call.index, {"id": "", "name": "", "arguments": ""})
                    slot["id"] = call.id or slot["id"]
                    slot["name"] += (call.function.name or "") if call.function else ""
                    slot["arguments"] += (call.function.arguments or "") if call.function else ""
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
        else:
            answer = (
                client.chat.completions.create(
                    model=args.model,
                    messages=messages,
                    tools=TOOLS,
                )
                .choices[0]
                .message
            )
            content = answer.content or ""
            tool_calls = [c.model_dump() for c in answer.tool_calls or []]
        messages.append(
            {"role": "assistant", "content": content, **({"tool_calls": tool_calls} if tool_calls else {})}
        )
        if not tool_calls:
            print(json.dumps({"answer": content}))
            return
        for call in tool_calls:
            messages.append({"role": "tool", "tool_call_id": call["id"], "content": "3C, rain"})
    raise SystemExit("the agent did not finish in 4 turns")


if __name__ == "__main__":
    main()
