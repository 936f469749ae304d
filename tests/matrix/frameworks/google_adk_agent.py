"""Google ADK: an `LlmAgent` with a tool on `LiteLlm`, run by `InMemoryRunner` with SSE streaming."""

from __future__ import annotations

from common import Endpoint, get_weather, question, react

NAME = "Google ADK"
PACKAGES = ["google-adk", "litellm"]
ENV = "adk"
CALLS = 2  # per rollout
SEQUENCES = 1  # per rollout, after chaining
STREAMED = "every call"
script = react


async def rollout(endpoint: Endpoint, k: int) -> str:
    from google.adk.agents import LlmAgent
    from google.adk.agents.run_config import RunConfig, StreamingMode
    from google.adk.models.lite_llm import LiteLlm
    from google.adk.runners import InMemoryRunner
    from google.genai import types

    model = LiteLlm(model=f"openai/{endpoint.model}", api_base=endpoint.base_url, api_key=endpoint.api_key)
    agent = LlmAgent(
        name="weather", model=model, instruction="Answer weather questions.", tools=[get_weather]
    )
    runner = InMemoryRunner(agent=agent, app_name="matrix")
    session = await runner.session_service.create_session(app_name="matrix", user_id="user")
    message = types.Content(role="user", parts=[types.Part(text=question(k))])
    answer = ""
    config = RunConfig(streaming_mode=StreamingMode.SSE)
    async for event in runner.run_async(
        user_id="user", session_id=session.id, new_message=message, run_config=config
    ):
        if event.is_final_response() and event.content and event.content.parts:
            answer = "".join(part.text or "" for part in event.content.parts)
    return answer
