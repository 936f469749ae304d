"""The client side imports and works with torch, vllm, transformers and langchain unavailable."""

from __future__ import annotations

import subprocess
import sys

BLOCKED = ["torch", "vllm", "transformers", "peft", "unsloth", "langchain", "langgraph", "langfuse", "wandb"]

SCRIPT = f"""
import sys
for name in {BLOCKED!r}:
    sys.modules[name] = None  # any import of it raises ImportError
import art_adapters as art
from art_adapters.recording import async_openai_client, http_client
from art_adapters.testing import Reply, ScriptedServer

with ScriptedServer([Reply(content="hi")]) as server:
    client = http_client()
    with art.capture() as trajectory:
        client.post(server.base_url + "/chat/completions",
                    json={{"model": "m", "messages": [{{"role": "user", "content": "x"}}]}})
assert trajectory.llm_calls[0].response["choices"][0]["message"]["content"] == "hi", trajectory
group = art.TrajectoryGroup([trajectory])
assert art.RemoteBackend and art.gather_trajectory_groups and art.TrainConfig().learning_rate > 0
model = art.TrainableModel(name="m", project="p", base_model="b")
print("light import ok", len(group))
"""


def test_client_side_works_without_heavy_packages() -> None:
    result = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "light import ok 1" in result.stdout
