"""Attack on per-call rewards (issue 40) in `art serve`'s record mode: the server mounts
`POST /rewards/{id}/calls/{n}` beside the trajectory route (backend/server.py), but only the standalone recording
endpoint's route was tested. Here the served route takes a call reward with the admin key only, answers "set",
"unchanged", 409 and 404 as the trajectory route does, and the stored call carries it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.capture.live import LiveRecorder
from art_adapters.store import open_store
from art_adapters.testing import Reply, ScriptedServer

pytest.importorskip("uvicorn")


def _scripted(request: dict[str, Any]) -> Reply:
    return Reply(content=f"answer {len(request['messages'])}")


async def test_serve_record_mode_takes_call_rewards(tmp_path: Path) -> None:
    from art_adapters.backend.server import create_app
    from test_remote_backend import FakeBackend

    store = open_store(tmp_path / "serve.db")
    with ScriptedServer(_scripted, cycle=True) as upstream:
        app = create_app(
            FakeBackend(tmp_path / "art", upstream.base_url),
            api_key="admin",
            inference_key="infer",
            allowed_base_models=["tiny"],
            record=LiveRecorder(store),
        )
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://test"
        ) as client:
            admin, infer = {"authorization": "Bearer admin"}, {"authorization": "Bearer infer"}
            model = art.TrainableModel(name="agent", project="prod", base_model="tiny")
            registered = await client.post(
                "/models/register", json={"model": model.model_dump(mode="json")}, headers=admin
            )
            assert registered.status_code == 200
            named = {**infer, "x-art-trajectory": "run-1"}
            for text in ("one", "two"):
                body = {"model": "agent", "messages": [{"role": "user", "content": text}]}
                answer = await client.post("/v1/chat/completions", json=body, headers=named)
                assert answer.status_code == 200, answer.text

            async def post(path: str, reward: float, headers: dict[str, str] = admin) -> httpx.Response:
                return await client.post(path, json={"reward": reward}, headers=headers)

            assert (await post("/rewards/run-1/calls/1", 0.5, infer)).status_code == 403
            first = await post("/rewards/run-1/calls/1", 0.5)
            assert first.status_code == 200, first.text
            assert first.json() == {"trajectory_id": "run-1", "call": 1, "status": "set"}
            assert (await post("/rewards/run-1/calls/1", 0.5)).json()["status"] == "unchanged"
            assert (await post("/rewards/run-1/calls/1", 0.0)).status_code == 409
            assert (await post("/rewards/run-1/calls/2", 1.0)).status_code == 404
            assert (await post("/rewards/run-1", 1.0)).json()["status"] == "set"
    trajectory = store.get("run-1")
    assert trajectory is not None and trajectory.reward == 1.0
    assert [c.reward for c in trajectory.llm_calls] == [None, 0.5]
    store.close()
