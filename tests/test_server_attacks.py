"""The server from an attacker's side: a client WITH a valid key tries to run code, reach vLLM's management routes
or another's model, and gets a clear refusal, while the backend and the upstream show that nothing happened."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

import art_adapters as art
from art_adapters.backend.server import create_app
from art_adapters.testing import ScriptedServer
from test_remote_backend import FakeBackend, running, trainable

ADMIN, INFERENCE = "admin-key-1", "inference-key-2"
CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def upstream() -> Iterator[ScriptedServer]:
    with ScriptedServer(None) as server:
        yield server


@pytest.fixture
def fake(tmp_path: Path, upstream: ScriptedServer) -> FakeBackend:
    return FakeBackend(tmp_path / "art", upstream.base_url)


@pytest.fixture
def served(fake: FakeBackend) -> Iterator[str]:
    app = create_app(fake, api_key=ADMIN, inference_key=INFERENCE, allowed_base_models=["tiny"])
    with running(app) as url:
        yield url


def as_user(url: str, key: str) -> httpx.Client:
    return httpx.Client(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=30)


def register(client: httpx.Client, **fields: Any) -> httpx.Response:
    model = {**trainable().model_dump(mode="json"), **fields}
    return client.post("/models/register", json={"model": model})


def test_registration_cannot_choose_engine_flags_environment_or_base_model(
    served: str, fake: FakeBackend, tmp_path: Path
) -> None:
    planted = tmp_path / "planted"
    planted.mkdir()
    (planted / "config.json").write_text("{}")
    (planted / "sitecustomize.py").write_text("open('/tmp/pwned', 'w')")
    with as_user(served, ADMIN) as admin:
        flags = register(
            admin, inference={"extra_args": ["--trust-remote-code"], "extra_env": {"PYTHONPATH": "/x"}}
        )
        assert flags.status_code == 422 and "cannot be chosen by a model" in flags.text
        tuned = register(admin, inference={"max_model_len": 64})
        assert tuned.status_code == 403 and "the server's to choose" in tuned.text
        for base in (str(planted), "evil-org/evil-model", "../../etc"):
            refused = register(admin, base_model=base)
            assert refused.status_code == 403 and "not allowed on this server" in refused.text, base
    assert [c for c in fake.calls if c[0] == "register"] == []  # the backend never saw any of them
    assert not Path("/tmp/pwned").exists()


def test_the_inference_key_samples_but_cannot_register_train_or_delete(
    served: str, fake: FakeBackend, upstream: ScriptedServer
) -> None:
    with as_user(served, ADMIN) as admin:
        answer = register(admin)
        assert (
            answer.status_code == 200 and answer.json()["api_key"] == INFERENCE
        )  # handed to rollout workers
    model = trainable().model_dump(mode="json")
    with as_user(served, INFERENCE) as worker:
        for path in (
            "/models/register",
            "/models/train",
            "/models/delete_checkpoints",
            "/models/log",
            "/health",
        ):
            refused = worker.post(path, json={"model": model, "groups": []})
            assert refused.status_code == 403 and "only opens /v1/*" in refused.text, path
        ok = worker.post("/v1/chat/completions", json={"model": "agent-1", **CHAT})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "echo: hi"
        anthropic_style = worker.post("/v1/messages", json={"model": "agent-1", "max_tokens": 8, **CHAT})
        assert (
            anthropic_style.status_code == 200 and anthropic_style.json()["content"][0]["text"] == "echo: hi"
        )
    assert [c[0] for c in fake.calls] == ["register"]
    assert len(upstream.requests) == 2


@pytest.mark.parametrize(
    "path",
    [
        "load_lora_adapter",
        "unload_lora_adapter",
        "sleep",
        "wake_up",
        "collective_rpc",
        "reset_prefix_cache",
        "../reset_prefix_cache",
        "chat/completions/../../load_lora_adapter",
        "%2e%2e/collective_rpc",
        "embeddings",
        "",
    ],
)
def test_the_proxy_forwards_only_inference_routes(served: str, upstream: ScriptedServer, path: str) -> None:
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
        refused = admin.post(f"/v1/{path}", json={"model": "agent-1", "lora_name": "x", "lora_path": "/tmp"})
    assert refused.status_code == 404, (path, refused.status_code, refused.text)
    assert upstream.requests == []  # refused before any upstream call


def test_a_model_the_server_did_not_register_is_refused(served: str, upstream: ScriptedServer) -> None:
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
        for name in ("scripted-model", "someone-else", None):  # the base model, another name, none at all
            body = {**CHAT, **({"model": name} if name else {})}
            refused = admin.post("/v1/chat/completions", json=body)
            assert refused.status_code == 404 and "not registered on this server" in refused.text
        listed = [m["id"] for m in admin.get("/v1/models").json()["data"]]
        assert listed == ["agent-1", "proj/agent-1"]  # the upstream's base model is not offered
    assert upstream.requests == []


async def test_remote_backend_refuses_engine_settings_before_sending(served: str, fake: FakeBackend) -> None:
    model = art.TrainableModel(
        name="agent-1",
        project="proj",
        base_model="tiny",
        _internal_config=art.dev.InternalModelConfig(engine_args=art.dev.EngineArgs(max_model_len=99)),
    )
    with pytest.raises(art.RemoteBackendError, match="the server's"):
        await model.register(art.RemoteBackend(served, api_key=ADMIN))
    assert fake.calls == []


def test_base_models_already_on_disk_are_allowed_by_default(tmp_path: Path, upstream: ScriptedServer) -> None:
    fake = FakeBackend(tmp_path / "art", upstream.base_url)
    record = tmp_path / "art" / "proj" / "models" / "old" / "model.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"name": "old", "project": "proj", "base_model": "disk-model"}))
    with running(create_app(fake, api_key=ADMIN)) as url, as_user(url, ADMIN) as admin:
        assert register(admin, base_model="disk-model").status_code == 200
        assert register(admin, base_model="tiny").status_code == 403  # not on disk, not allowed at start


def deep(levels: int) -> dict[str, Any]:
    inner: dict[str, Any] = {}
    top = inner
    for _ in range(levels):
        inner["a"] = {}
        inner = inner["a"]
    return top


def test_engine_fields_deep_nesting_and_odd_bodies_never_reach_the_engine(
    served: str, upstream: ScriptedServer
) -> None:
    """A 1.9 kB body with `kv_transfer_params` nested 900 deep killed vLLM for good; bodies nested 100,000 deep and
    a non-string `model` answered 500. Each is now a clear 4xx before anything is sent upstream, and the
    engine-internal fields of an ordinary request are dropped on the way."""
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
    with as_user(served, INFERENCE) as worker:
        attack = {"model": "agent-1", **CHAT, "kv_transfer_params": deep(900)}
        assert len(json.dumps(attack)) < 8000
        refused = worker.post("/v1/chat/completions", json=attack)
        assert refused.status_code == 400 and "nested deeper than 64" in refused.text
        bomb = worker.post(
            "/v1/chat/completions", content=b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        )
        assert bomb.status_code == 400 and "nested deeper" in bomb.text
        for model in (7, ["agent-1"], {"name": "agent-1"}):
            odd = worker.post("/v1/chat/completions", json={"model": model, **CHAT})
            assert odd.status_code == 400 and "'model' must be a string" in odd.text
        assert worker.post("/v1/chat/completions", content=b"[1, 2]").status_code == 400
        assert upstream.requests == []
        internal = {
            "kv_transfer_params": {"do_remote_prefill": True},
            "ec_transfer_params": {"x": 1},
            "vllm_xargs": {"k": 1},
            "request_id": "someone-elses-id",
            "chat_template": "{{ raise_exception('pwned') }}",
        }
        ok = worker.post("/v1/chat/completions", json={"model": "agent-1", **CHAT, **internal})
        assert ok.status_code == 200
    (sent,) = upstream.requests
    assert not set(internal) & set(sent) and sent["model"] == "agent-1"


@pytest.mark.parametrize(
    ("asked", "message"),
    [
        ({"n": 16384, "max_tokens": 2000, "ignore_eos": True}, "n=16384 is over this server's limit of 64"),
        ({"best_of": 65}, "n=65 is over"),
        ({"n": 64, "max_tokens": 8192}, "asks for more than this server's 262144 output tokens"),
        ({"n": -1}, "'n' must be a non-negative integer"),
        ({"max_tokens": "lots"}, "'max_tokens' must be a non-negative integer"),
    ],
)
def test_a_request_asking_for_unbounded_work_is_refused(
    served: str, upstream: ScriptedServer, asked: dict[str, Any], message: str
) -> None:
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
    with as_user(served, INFERENCE) as worker:
        refused = worker.post("/v1/chat/completions", json={"model": "agent-1", **CHAT, **asked})
    assert refused.status_code == 400 and message in refused.text, refused.text[:300]
    assert upstream.requests == []


def test_names_are_checked_whole_and_leak_nothing(served: str, upstream: ScriptedServer) -> None:
    """`re.match(...$)` let a trailing newline through; a 404 listed every registered model."""
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
        assert register(admin, name="agent-1\n").status_code == 422
        assert register(admin, project="proj\n").status_code == 422
        for name in ("agent-1\n", "proj/agent-1\n", "other"):
            refused = admin.post("/v1/chat/completions", json={"model": name, **CHAT})
            assert refused.status_code == 404 and "registered:" not in refused.text
        assert "agent-1" not in refused.text  # a wrong name learns nothing of the names that exist
    assert upstream.requests == []
    with pytest.raises(ValueError, match="must match"):
        art.TrainableModel(name="agent\n", project="p", base_model="tiny")


class TwoBaseModels(FakeBackend):
    """Models of two base models, each served by its own engine (as LocalBackend runs one vLLM per base model),
    under project-qualified names."""

    def __init__(self, path: Path, engines: dict[str, str]) -> None:
        super().__init__(path, "")
        self.engines = engines

    async def register(self, model: art.Model) -> Any:
        endpoint = await super().register(model)
        base_model = getattr(model, "base_model", "")
        return endpoint.model_copy(
            update={"base_url": self.engines[base_model], "model_name": f"{model.project}/{model.name}"}
        )


def test_two_projects_on_different_base_models_never_share_a_bare_name(tmp_path: Path) -> None:
    """The bare `agent` went to whichever project registered last, so one project sampled (and trained on) the
    other's adapter, on another tokenizer. Each project's name reaches its own engine; the bare name answers
    while one project alone uses it, then a clear 404."""
    with ScriptedServer(None, model="engine-a") as a, ScriptedServer(None, model="engine-b") as b:
        backend = TwoBaseModels(tmp_path / "art", {"base-a": a.base_url, "base-b": b.base_url})
        app = create_app(
            backend, api_key=ADMIN, inference_key=INFERENCE, allowed_base_models=["base-a", "base-b"]
        )
        with running(app) as url, as_user(url, ADMIN) as admin:
            assert register(admin, name="agent", project="alpha", base_model="base-a").status_code == 200
            assert admin.post("/v1/chat/completions", json={"model": "agent", **CHAT}).status_code == 200
            assert a.requests[-1]["model"] == "alpha/agent"
            assert register(admin, name="agent", project="beta", base_model="base-b").status_code == 200
            shared = admin.post("/v1/chat/completions", json={"model": "agent", **CHAT})
            assert shared.status_code == 404 and "more than one project" in shared.text
            for project, engine in (("alpha", a), ("beta", b)):
                for suffix in ("", "@3"):
                    asked = {"model": f"{project}/agent{suffix}", **CHAT}
                    assert admin.post("/v1/chat/completions", json=asked).status_code == 200
                    assert engine.requests[-1]["model"] == f"{project}/agent{suffix}"
            listed = [m["id"] for m in admin.get("/v1/models").json()["data"]]
            assert listed == ["alpha/agent", "beta/agent"]
    assert len(a.requests) == 3 and len(b.requests) == 2


def test_a_failed_registration_leaves_no_name_behind(served: str, fake: FakeBackend) -> None:
    async def failing(model: art.Model) -> Any:
        raise RuntimeError("engine failed to start")

    fake.register = failing  # type: ignore[method-assign]
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 500
        for name in ("agent-1", "proj/agent-1"):
            assert admin.post("/v1/chat/completions", json={"model": name, **CHAT}).status_code == 404
        assert admin.get("/v1/models").json()["data"] == []


def test_engine_settings_are_refused_on_the_server_whatever_their_values(
    served: str, fake: FakeBackend
) -> None:
    """`_internal_config.engine_args` in a raw register body reached vLLM's argv."""
    with as_user(served, ADMIN) as admin:
        for engine_args in ({"enforce_eager": True}, {"max_model_len": 64}):
            raw = register(admin, _internal_config={"engine_args": engine_args})
            assert raw.status_code == 403 and "the server's to choose" in raw.text
        unknown = register(admin, _internal_config={"engine_args": {"extra_args": ["--trust-remote-code"]}})
        assert unknown.status_code == 400 and "not supported" in unknown.text
    assert [c for c in fake.calls if c[0] == "register"] == []


@pytest.mark.parametrize(
    ("prompt", "message"),
    [
        (["x"] * 200_000, "200000 prompts x n=1 = 200000 choices, over this server's limit of 64"),
        ([[1, 2]] * 65, "65 prompts x n=1 = 65 choices"),
        (["x"] * 8, "8 prompts x n=8 x max_tokens=8192 asks for more than this server's 262144"),
    ],
)
def test_a_list_of_prompts_counts_as_that_many_requests(
    served: str, upstream: ScriptedServer, prompt: list[Any], message: str
) -> None:
    """`prompt` as a list was counted as one prompt: 200,000 prompts in a 0.95 MiB body asked for 52 billion
    output tokens and were accepted."""
    with as_user(served, ADMIN) as admin:
        assert register(admin).status_code == 200
    n = 8 if len(prompt) == 8 else 1
    with as_user(served, INFERENCE) as worker:
        asked = {"model": "agent-1", "prompt": prompt, "n": n, "max_tokens": 8192 if n == 8 else 16}
        refused = worker.post("/v1/completions", json=asked)
        assert refused.status_code == 400 and message in refused.text, refused.text[:300]
        for fine in ("one prompt", [1, 2, 3], ["a", "b"], [[1, 2], [3]]):
            ok = worker.post("/v1/completions", json={"model": "agent-1", "prompt": fine, "max_tokens": 4})
            assert ok.status_code == 200, (fine, ok.text)
    assert len(upstream.requests) == 4
