"""Test helpers: ScriptedServer, a real OpenAI-compatible HTTP server answering from a script of Replies.

from art_adapters.testing import Reply, ScriptedServer

with ScriptedServer([Reply(content="4"), Reply(status=500), Reply(cut_stream_after=3)]) as server:
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    ...
    server.requests  # the JSON bodies received
"""

from .replies import Reply, prompt_text, token_ids
from .server import ScriptedServer
from .steer import steer

__all__ = ["Reply", "ScriptedServer", "prompt_text", "steer", "token_ids"]
