"""Per-agent adapters over RemoteBackend on the real stack: `serve`'s app (uvicorn on 127.0.0.1) over a LocalBackend
on the real vLLM server. One step on two agents' calls over HTTP trains each agent's adapter and returns per-agent
metrics; each agent is then served its own weights; a server restarted on the same folder resumes every agent; a
client with a valid key gets a clear 4xx for bad names and too many agents, and nothing lands outside the folder."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.remote import RemoteBackend, RemoteBackendError
from art_adapters.backend.server import create_app
from art_adapters.backend.serving import served_prompt_logprobs
from art_adapters.inference import VLLMServer
from test_remote_backend import running

pytestmark = [pytest.mark.vllm, pytest.mark.train]
aio = pytest.mark.asyncio(loop_scope="session")
KEY = "admin-key"
SWAP_TOLERANCE = 1e-4


async def as_agent(model: art.TrainableModel, agent: str, seed: int) -> art.Trajectory:
    async with art.capture() as trajectory:
        with art.role(agent):
            await model.openai_client().chat.completions.create(
                model=model.get_inference_name(),
                messages=[{"role": "user", "content": f"Say a word ({seed})."}],
                max_tokens=6,
                seed=seed,
            )
    return trajectory


def per_agent(name: str, server: VLLMServer, adapters: art.PerAgent) -> art.TrainableModel:
    return art.TrainableModel(
        name=name,
        project="remote",
        base_model=str(server.base_model),
        lora=art.LoRAConfig(rank=8, alpha=16),
        adapters=adapters,
    )


def tensors(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def files_under(path: Path) -> set[Path]:
    return {p for p in path.rglob("*") if p.is_file()}


def escaped(tmp_path: Path) -> bool:
    return (tmp_path / "escape").exists() or Path("/abs/x").exists()


def handmade(roles: list[str]) -> art.TrajectoryGroup:
    """Trajectories whose captured calls name `roles` (never sent: the step must be refused before it trains)."""
    call = {"request": {"model": "remote/open"}, "completion_token_ids": [1, 2]}
    return art.TrajectoryGroup(
        art.Trajectory(llm_calls=[art.LLMCall(**call, source=art.CallSource(role=r))], reward=float(i))
        for i, r in enumerate(roles)
    )


@aio
@pytest.mark.timeout(1500)
async def test_per_agent_training_serving_resume_and_refusals_over_serve(
    vllm_server: VLLMServer, tmp_path: Path
) -> None:
    root, base = tmp_path / "art", str(vllm_server.base_model)
    backend = art.LocalBackend(root).use_server(vllm_server)
    with running(create_app(backend, api_key=KEY, allowed_base_models=[base])) as url:
        model = per_agent("m", vllm_server, art.PerAgent(by="role", agents=["a", "b"]))
        await model.register(RemoteBackend(url, api_key=KEY))
        trajectories = [await as_agent(model, agent, k) for agent in ("a", "b") for k in range(2)]
        assert [t.llm_calls[0].served_model for t in trajectories] == ["remote/m.a@0"] * 2 + [
            "remote/m.b@0"
        ] * 2
        for trajectory, reward in zip(trajectories, [0.0, 1.0, 1.0, 0.0], strict=True):
            trajectory.reward = reward  # the same samples, opposite rewards: a and b must move apart
        metrics = await model.train([art.TrajectoryGroup(trajectories)], art.TrainConfig(learning_rate=5e-2))
        assert metrics["adapters_trained"] == 2 and await model.get_step() == 1
        for agent in ("a", "b"):
            assert (
                metrics[f"agent/{agent}/trained_tokens"] > 0 and metrics[f"agent/{agent}/trajectories"] == 2
            )
            assert {"loss", "grad_norm", "reward_mean"} <= {k.split("/")[-1] for k in metrics if agent in k}
        folder = root / "remote/models/m"
        step0, step1 = (checkpoints.checkpoint_dir(folder, s) for s in (0, 1))
        assert checkpoints.checkpoint_agents(step1) == ["a", "b"]
        for agent in ("a", "b"):  # each agent's adapter trained
            before, after = tensors(step0 / "agents" / agent), tensors(step1 / "agents" / agent)
            assert any(not torch.equal(before[k], after[k]) for k in before)
        served = {agent: await as_agent(model, agent, 9) for agent in ("a", "b", "nobody")}
        tried = {
            a: [(c.status_code, c.error, c.served_model) for c in t.llm_calls] for a, t in served.items()
        }
        assert {a: t.llm_calls[-1].served_model for a, t in served.items()} == {
            "a": "remote/m.a@1",
            "b": "remote/m.b@1",
            "nobody": "remote/m@1",  # not listed: the shared adapter
        }, tried  # the last attempt (an idle keep-alive connection the server closed is retried)
        call = trajectories[0].llm_calls[0]
        ids = list(call.prompt_token_ids or []) + list(call.completion_token_ids or [])
        logprobs = {a: await served_prompt_logprobs(vllm_server, f"remote/m.{a}@1", ids) for a in ("a", "b")}
        assert max(abs(x - y) for x, y in zip(logprobs["a"], logprobs["b"], strict=True)) > 1e-3

        # a client with a valid key: bad names and too many agents are clear 4xx, nothing outside the folder
        files_before = files_under(tmp_path)
        async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {KEY}"}) as http:
            for name in ("remote/m.../../../etc", "remote/m.a/../b", "remote/m.ghost"):
                answer = await http.post(
                    "/v1/chat/completions",
                    json={"model": name, "messages": [{"role": "user", "content": "x"}]},
                )
                assert answer.status_code == 404, (name, answer.text)
        open_list = per_agent("open", vllm_server, art.PerAgent(by="role"))  # every role gets an adapter
        await open_list.register(RemoteBackend(url, api_key=KEY))
        with pytest.raises(RemoteBackendError, match=r"3 agents without an adapter.*at most 3") as refused:
            await open_list.train([handmade(["x", "y", "z"])])
        assert refused.value.status == 400 and await open_list.get_step() == 0
        paths = per_agent("paths", vllm_server, art.PerAgent(by="agent", agents=["../../escape", "/abs/x"]))
        await paths.register(RemoteBackend(url, api_key=KEY))
        held = checkpoints.checkpoint_agents(checkpoints.checkpoint_dir(root / "remote/models/paths", 0))
        assert len(held) == 2 and all(a.startswith(("escape-", "abs_x-")) for a in held)
        new = files_under(tmp_path) - files_before
        assert new and all(p.is_relative_to(root / "remote/models") for p in new)
        assert not escaped(tmp_path)

    # `serve` restarted on the same folder: the model resumes at step 1 with every agent's adapter
    again = art.LocalBackend(root).use_server(vllm_server)
    with running(create_app(again, api_key=KEY, allowed_base_models=[base])) as url:
        model = per_agent("m", vllm_server, art.PerAgent(by="role", agents=["a", "b"]))
        await model.register(RemoteBackend(url, api_key=KEY))
        assert await model.get_step() == 1
        assert (await as_agent(model, "b", 3)).llm_calls[0].served_model == "remote/m.b@1"
        for agent in ("a", "b"):  # the resumed trainer's adapters are what was trained (and what vLLM serves)
            assert await again.served_logprob_diff(model, ids, agent=agent) <= SWAP_TOLERANCE
