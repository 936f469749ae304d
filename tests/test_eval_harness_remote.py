"""art.evaluate through RemoteBackend: `art-adapters serve`'s app serves any checkpointed step of the model
(`/models/checkpoint_steps`, `/models/serve_step`) and proxies each version's requests to its engine."""

from __future__ import annotations

from pathlib import Path

import pytest

import art_adapters as art
from art_adapters.backend.remote import RemoteBackend, RemoteBackendError
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer
from eval_fakes import IMPROVED, NAME, PROJECT, QUESTIONS, StepServingBackend, grader, rollout
from test_remote_backend import running


class Served(StepServingBackend):
    """StepServingBackend with the rest of the Backend protocol the server's app touches."""

    async def close(self) -> None:
        pass


async def test_remote_backend_serves_any_step_for_an_evaluation() -> None:
    with ScriptedServer(grader(3)) as engine:
        backend = Served(engine.base_url, (0, 1, 3))
        app = create_app(backend, api_key="server-key", allowed_base_models=["tiny"])  # type: ignore[arg-type]
        with running(app) as url:
            remote = RemoteBackend(base_url=url, api_key="server-key")
            model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
            await model.register(remote)
            result = await art.evaluate(
                model, rollout, QUESTIONS, attempts=2, steps=[0, 1, "latest"], progress=False
            )
            with pytest.raises(ValueError, match=r"step 2 of model 'agent' has no checkpoint"):
                await art.evaluate(model, rollout, QUESTIONS, steps=[2], progress=False)
            await remote.close()
    assert backend.served == [0, 1, 3]
    assert [t.target for t in result.targets] == ["step 0", "step 1", "step 3"]
    assert sorted(result.comparisons[-1].changes.improved) == sorted(IMPROVED)
    assert result.comparisons[0].changes.improved == []  # step 1 learnt nothing


async def test_a_server_whose_backend_cannot_serve_old_steps_says_so(tmp_path: Path) -> None:
    from test_remote_backend import FakeBackend

    with ScriptedServer(grader(3)) as engine:
        fake = FakeBackend(tmp_path, engine.base_url)
        with running(create_app(fake, api_key="k", allowed_base_models=["tiny"])) as url:  # type: ignore[arg-type]
            remote = RemoteBackend(base_url=url, api_key="k")
            model = art.TrainableModel(name=NAME, project=PROJECT, base_model="tiny")
            await model.register(remote)
            with pytest.raises(RemoteBackendError, match="FakeBackend cannot serve older steps"):
                await art.evaluate(model, rollout, QUESTIONS, progress=False)
            await remote.close()
