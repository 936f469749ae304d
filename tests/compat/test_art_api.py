"""ART's names and semantics a port observes, written as ART users write the calls (`import art_adapters as art`)."""

from __future__ import annotations

import asyncio
import copy
import importlib
import json
import time
from pathlib import Path

import httpx
import pytest
from openai.types.chat.chat_completion import Choice

import art_adapters as art
from art_adapters.testing import Reply, ScriptedServer

ART_PATHS = {
    "art_adapters.local": ["LocalBackend"],
    "art_adapters.trajectories": [
        "Trajectory",
        "TrajectoryGroup",
        "History",
        "PydanticException",
        "get_messages",
        "trajectory",
        "trajectory_group",
        "current_trajectory",
    ],
    "art_adapters.utils": [
        "iterate_dataset",
        "limit_concurrency",
        "retry",
        "format_message",
        "log_http_errors",
        "get_model_step",
        "strip_logprobs",
        "output_dirs",
    ],
    "art_adapters.utils.output_dirs": [
        "get_model_dir",
        "get_step_checkpoint_dir",
        "get_trajectories_split_dir",
    ],
    "art_adapters.utils.iterate_dataset": ["iterate_dataset", "DatasetBatch"],
    "art_adapters.utils.strip_logprobs": ["strip_logprobs"],
    "art_adapters.utils.retry": ["retry"],
    "art_adapters.dev": ["TrainConfig", "TrainSFTConfig", "InternalModelConfig", "InitArgs", "EngineArgs"],
    "art_adapters.rewards": ["ruler", "ruler_score_group"],
    "art_adapters.langgraph": ["wrap_rollout", "init_chat_model"],
    "art_adapters.serverless": ["ServerlessBackend"],
}
ROOT_NAMES = [
    "retry",
    "Messages",
    "MessagesAndChoices",
    "Tools",
    "auto_trajectory",
    "capture_auto_trajectory",
    "yield_trajectory",
    "capture_yielded_trajectory",
    "gather_trajectories",
    "gather_trajectory_groups",
    "trajectory_group_batches",
    "TrainSFTConfig",
    "TrainResult",
    "TrainConfig",
    "Backend",
    "dev",
    "LoRAConfig",
    "trajectory",
    "trajectory_group",
    "current_trajectory",
    "current_trajectory_group",
    "LocalTrainResult",
    "ServerlessTrainResult",
    "MegatronTopologyConfig",
    "PydanticException",
]


@pytest.mark.parametrize("module", sorted(ART_PATHS))
def test_module_paths_a_port_keeps(module: str) -> None:
    loaded = importlib.import_module(module)
    for name in ART_PATHS[module]:
        assert getattr(loaded, name) is not None, f"{module}.{name}"


def test_root_names() -> None:
    for name in ROOT_NAMES:
        assert getattr(art, name) is not None, name
    with pytest.raises(AttributeError):
        art.no_such_name  # noqa: B018


def test_backend_is_a_protocol(tmp_path: Path) -> None:
    assert isinstance(art.LocalBackend(tmp_path), art.Backend)
    assert isinstance(art.RemoteBackend("http://127.0.0.1:1"), art.Backend)
    assert not isinstance(object(), art.Backend)


async def test_local_backend_as_sync_and_async_context_manager(tmp_path: Path) -> None:
    with art.LocalBackend(tmp_path) as backend:
        assert isinstance(backend, art.LocalBackend)
    async with art.LocalBackend(tmp_path) as backend:
        assert backend.path.name == tmp_path.name


# ---- the data model -------------------------------------------------------------------------------------------


def test_messages_turn_none_content_into_empty_strings() -> None:
    choice = Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
        }
    )
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": None}, choice])
    messages = trajectory.messages()
    assert messages[0] == {"role": "user", "content": ""}
    assert messages[1]["content"] == "" and messages[1]["tool_calls"][0]["function"]["name"] == "f"


def test_finish_records_duration_and_track_duration_adds_up() -> None:
    trajectory = art.Trajectory()
    time.sleep(0.01)
    assert trajectory.finish().metrics["duration"] >= 0.01

    async def tracked() -> None:
        async with trajectory.track_duration("tool"):
            await asyncio.sleep(0.01)
        async with trajectory.track_duration("tool"):
            await asyncio.sleep(0.01)

    asyncio.run(tracked())
    assert trajectory.metrics["tool_duration"] >= 0.02


def test_groups_copy_and_exceptions_as_art_builds_them() -> None:
    group = art.TrajectoryGroup([art.Trajectory(reward=1.0)], exceptions=[ValueError("bad tool")])
    assert group.exceptions[0].type == "ValueError" and group.exceptions[0].message == "bad tool"
    assert group.exceptions[0]["type"] == "ValueError"  # the JSON shape reads the same
    shallow = copy.copy(group)
    shallow.trajectories.append(art.Trajectory())
    shallow.metadata["k"] = 1
    assert len(group.trajectories) == 1 and group.metadata == {}
    deep = copy.deepcopy(group)
    deep.trajectories[0].reward = 5.0
    assert group.trajectories[0].reward == 1.0
    group.log("a note")
    assert group.logs == ["a note"]
    mixed = art.TrajectoryGroup([art.Trajectory(), RuntimeError("x")])
    assert len(mixed) == 1 and mixed.exceptions[0].type == "RuntimeError"
    back = art.TrajectoryGroup.model_validate_json(group.model_dump_json())
    assert back.exceptions[0].message == "bad tool"


def test_for_logging_marks_sampled_turns() -> None:
    choice = Choice.model_validate(
        {"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "4"}}
    )
    trajectory = art.Trajectory(messages_and_choices=[{"role": "user", "content": "2+2"}, choice], reward=1)
    logged = trajectory.for_logging()
    assert [m["trainable"] for m in logged["messages"]] == [False, True]
    assert logged["reward"] == 1 and json.dumps(logged)


async def test_gather_trajectories_returns_exceptions_in_place() -> None:
    async def rollout(k: int) -> art.Trajectory:
        if k == 1:
            raise RuntimeError("rollout 1 failed")
        return art.Trajectory(reward=k, metrics={"turns": k})

    results = await art.gather_trajectories((rollout(k) for k in range(3)), max_exceptions=1, pbar_desc=None)
    assert isinstance(results[1], RuntimeError) and [r.reward for r in (results[0], results[2])] == [0, 2]
    with pytest.raises(RuntimeError, match="rollout 1 failed"):
        await art.gather_trajectories((rollout(k) for k in range(3)), pbar_desc=None)

    async def two() -> list[art.Trajectory]:
        return [art.Trajectory(reward=1), art.Trajectory(reward=2)]

    (pair,) = await art.gather_trajectories([two()], pbar_desc=None)
    assert [t.reward for t in pair] == [1, 2]
    groups = await art.gather_trajectory_groups(
        [art.TrajectoryGroup(rollout(k) for k in (0, 2))], pbar_desc="gather", max_metrics=1
    )
    assert [t.reward for t in groups[0]] == [0, 2]


async def test_trajectory_group_batches_yields_full_batches_as_groups_finish() -> None:
    async def rollout(k: int) -> art.Trajectory:
        await asyncio.sleep(0.001 * (5 - k))
        return art.Trajectory(reward=k)

    batches = [
        [g.trajectories[0].reward for g in batch]
        async for batch in art.trajectory_group_batches(
            (art.TrajectoryGroup([rollout(k)]) for k in range(5)), batch_size=2, pbar_desc=None
        )
    ]
    assert [len(b) for b in batches] == [2, 2, 1] and sorted(sum(batches, [])) == [0, 1, 2, 3, 4]
    resumed = [
        batch
        async for batch in art.trajectory_group_batches(
            (art.TrajectoryGroup([rollout(k)]) for k in range(5)),
            batch_size=2,
            skip_batches=2,
            pbar_desc=None,
        )
    ]
    assert [[g.trajectories[0].reward for g in b] for b in resumed] == [[4]]


# ---- prompted models ----------------------------------------------------------------------------------------------


async def test_prompted_model_has_step_zero_and_logs_to_its_folder(tmp_path: Path) -> None:
    model = art.Model(
        name="gpt-4.1", project="compare", base_path=str(tmp_path), inference_base_url="http://x/v1"
    )
    assert await model.get_step() == 0
    group = art.TrajectoryGroup([art.Trajectory(reward=0.25), art.Trajectory(reward=0.75)])
    row = await model.log([group], split="val")
    assert row["val/reward"] == 0.5
    await model.log(metrics={"accuracy": 0.9}, step=3)
    folder = tmp_path / "compare" / "models" / "gpt-4.1"
    assert len((folder / "trajectories" / "val" / "0000.jsonl").read_text().splitlines()) == 2
    rows = [json.loads(line) for line in (folder / "history.jsonl").read_text().splitlines()]
    assert rows[-1] == {"step": 3, "split": "val", "val/accuracy": 0.9}
    params = model.litellm_completion_params()
    assert params["model"] == "gpt-4.1" and params["base_url"] == "http://x/v1"
    with pytest.raises(RuntimeError, match="not registered"):
        model.backend()


def test_trainable_model_takes_arts_constructor_forms() -> None:
    model = art.TrainableModel(
        name="m",
        project="p",
        base_model="b",
        lora_config=art.dev.LoRAConfig(rank=4, alpha=8),
        _internal_config=art.dev.InternalModelConfig(init_args=art.dev.InitArgs(max_seq_length=1024)),
    )
    assert model.lora.rank == 4 and model.train_defaults(None).max_seq_len == 1024
    assert model.trainer_max_seq_len() == 1024
    assert model.inference_settings() == {}
    model._internal_config = art.dev.InternalModelConfig(engine_args=art.dev.EngineArgs(enforce_eager=True))
    assert model.inference_settings() == {"enforce_eager": True} and model.trainer_max_seq_len() is None
    assert model.get_inference_name(3) == "m@3"
    with pytest.raises(ValueError, match="bias"):
        art.TrainableModel(name="m", project="p", base_model="b", lora_config={"rank": 4, "bias": "all"})
    model._internal_config = {"engine_args": {"tensor_parallel_size": 2}}
    with pytest.raises(art.UnsupportedARTSetting, match="tensor_parallel_size"):
        model.inference_settings()
    with pytest.raises(ValueError, match="extra_args"):
        art.TrainableModel(name="m", project="p", base_model="b", inference={"extra_args": ["--x"]})


# ---- utils ----------------------------------------------------------------------------------------------------


def test_iterate_dataset_is_seeded_and_resumable() -> None:
    from art_adapters.utils import iterate_dataset

    data = list(range(10))
    full = [(b.step, b.epoch, b.epoch_step, b.items) for b in iterate_dataset(data, 4, 2, use_tqdm=False)]
    assert [s for s, *_ in full] == list(range(6)) and [len(b[3]) for b in full] == [4, 4, 2, 4, 4, 2]
    assert sorted(sum((b[3] for b in full[:3]), [])) == data  # each epoch covers the data once
    resumed = [
        (b.step, b.epoch, b.epoch_step, b.items) for b in iterate_dataset(data, 4, 2, 4, use_tqdm=False)
    ]
    assert resumed == full[4:]


async def test_retry_and_limit_concurrency() -> None:
    from art_adapters.utils import limit_concurrency, retry

    calls: list[int] = []

    @retry(max_attempts=3, delay=0, exceptions=(ValueError,), on_retry=lambda e, n: calls.append(n))
    async def flaky() -> str:
        if len(calls) < 2:
            raise ValueError("not yet")
        return "ok"

    assert await flaky() == "ok" and calls == [1, 2]

    @retry(max_attempts=2, delay=0)
    def always() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError):
        always()

    running = peak = 0

    @limit_concurrency(2)
    async def work() -> None:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.01)
        running -= 1

    await asyncio.gather(*(work() for _ in range(6)))
    assert peak == 2


async def test_log_http_errors_names_status_url_and_detail() -> None:
    from art_adapters.utils import log_http_errors

    with ScriptedServer(Reply(status=404, raw_body=json.dumps({"detail": "no such model"}))) as server:

        @log_http_errors
        async def call() -> None:
            async with httpx.AsyncClient() as client:
                (await client.post(server.base_url + "/chat/completions", json={})).raise_for_status()

        with pytest.raises(Exception, match=r"\[HTTP 404\] .*/chat/completions no such model"):
            await call()


def test_format_message_strip_logprobs_and_paths(tmp_path: Path) -> None:
    from art_adapters.utils import format_message, get_model_step, strip_logprobs
    from art_adapters.utils.output_dirs import (
        get_model_dir,
        get_models_dir,
        get_output_dir_from_model_properties,
        get_step_checkpoint_dir,
        get_trajectories_split_dir,
    )

    text = format_message(
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}],
        }
    )
    assert text == "Assistant:\nLet me look.\nf({})"
    data = {"choices": [{"logprobs": {"content": [1]}, "message": "m"}]}
    assert strip_logprobs(data) == {"choices": [{"message": "m"}]} and "logprobs" in data["choices"][0]
    model = art.TrainableModel(name="m", project="p", base_model="b")
    folder = get_model_dir(model, str(tmp_path))
    assert folder == str(tmp_path / "p" / "models" / "m")
    Path(get_step_checkpoint_dir(folder, 7)).mkdir(parents=True)
    assert get_model_step(model, str(tmp_path)) == 7
    assert get_models_dir("p", str(tmp_path)) == str(tmp_path / "p" / "models")
    assert get_output_dir_from_model_properties("p", "m", str(tmp_path)) == folder
    assert get_trajectories_split_dir(folder, "val") == str(Path(folder) / "trajectories" / "val")
    with pytest.raises(ValueError, match="must match"):
        get_trajectories_split_dir(folder, "../../etc")
    with pytest.raises(ValueError, match="must match"):
        get_model_dir(art.Model.model_construct(name="../x", project="p", base_path="."))


# ---- what is not shipped -----------------------------------------------------------------------------------------


async def test_unshipped_backends_and_s3_say_what_to_use_instead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("BACKUP_BUCKET", raising=False)
    for name in (
        "ServerlessBackend",
        "TinkerBackend",
        "MegatronBackend",
        "SkyPilotBackend",
        "MegatronTopologyConfig",
    ):
        with pytest.raises(art.UnsupportedBackendError, match="RemoteBackend"):
            getattr(art, name)()
    from art_adapters.serverless import ServerlessBackend

    with pytest.raises(art.UnsupportedBackendError):
        ServerlessBackend(api_key="x")
    model = art.TrainableModel(name="m", project="p", base_model="b")
    from art_adapters.backend.s3 import S3SyncError

    with pytest.raises(S3SyncError, match="no S3 bucket: pass s3_bucket"):
        await art.LocalBackend(tmp_path)._experimental_pull_from_s3(model, verbose=True)
    with pytest.raises(art.UnsupportedARTSetting, match="does not take bucket names from clients"):
        await art.RemoteBackend("http://127.0.0.1:1")._experimental_push_to_s3(model)
