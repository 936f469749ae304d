"""DSPy: `dspy.ReAct` with a tool on `dspy.LM` (LiteLLM underneath), ChatAdapter's field format. Every step is a
new prompt holding the trajectory so far as text, so no call continues another."""

from __future__ import annotations

from common import ANSWER, Endpoint, question, turns

NAME = "DSPy (ReAct)"
PACKAGES = ["dspy", "litellm"]
ENV = "frameworks"
CALLS = 3  # per rollout: the tool, finish, the extraction
SEQUENCES = 3  # per rollout, after chaining
WHY = "every step is a fresh prompt holding the trajectory so far as text"
STREAMED = "none"
ROUTE = "endpoint"  # LiteLLM sends through aiohttp here, out of the in-process hook's reach


def fields(**values: str) -> str:
    return "".join(f"[[ ## {k} ## ]]\n{v}\n\n" for k, v in values.items()) + "[[ ## completed ## ]]"


def script(body: dict) -> str:
    history = turns(body)
    system, last = history[0]["content"], history[-1]["content"]
    if "next_tool_name" in system:
        if "observation_0" in last:
            return fields(next_thought="I know it.", next_tool_name="finish", next_tool_args="{}")
        return fields(
            next_thought="Ask the tool.", next_tool_name="get_weather", next_tool_args='{"city": "Oslo"}'
        )
    return fields(reasoning="The tool said so.", answer=ANSWER)


async def rollout(endpoint: Endpoint, k: int) -> str:
    import dspy

    def get_weather(city: str) -> str:
        """The weather in a city."""
        return "3C, rain"

    lm = dspy.LM(
        f"openai/{endpoint.model}", api_base=endpoint.base_url, api_key=endpoint.api_key, cache=False
    )
    agent = dspy.ReAct("question -> answer", tools=[get_weather])
    with dspy.context(lm=lm):
        return (await agent.acall(question=question(k))).answer
