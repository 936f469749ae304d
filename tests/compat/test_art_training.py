"""Both of ART's training styles, as ART users call them, against a backend that records what each step asked for:
`model.train(groups, config=art.TrainConfig(...), _config=art.dev.TrainConfig(...))` (<= 0.5.17) and
`backend.train(model, groups, learning_rate=..., loss_fn=..., ...)` + `model.log(...)` (>= 0.5.18), in process and
through `art-adapters serve` + RemoteBackend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

import art_adapters as art
from art_adapters.backend.base import ARTTraining, InferenceEndpoint
from art_adapters.backend.server import create_app
from test_remote_backend import running


class RecordingBackend(ARTTraining):
    """The Backend protocol in memory: each step's TrainConfig and `record` flag are kept; logs land in files."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.steps: list[tuple[art.TrainConfig, bool]] = []
        self.sft: list[art.SFTConfig] = []
        self.step = 0

    async def register(self, model: art.Model) -> InferenceEndpoint:
        return InferenceEndpoint(base_url="http://127.0.0.1:9/v1", api_key="k", model_name=model.name)

    async def get_step(self, model: art.TrainableModel) -> int:
        return self.step

    async def train_events(
        self,
        model: art.TrainableModel,
        groups: list[art.TrajectoryGroup],
        config: art.TrainConfig,
        *,
        record: bool = True,
    ) -> AsyncIterator[dict[str, Any]]:
        self.steps.append((config, record))
        yield {"event": "started", "step": self.step}
        self.step += 1
        rewards = [t.reward for g in groups for t in g]
        yield {
            "event": "done",
            "step": self.step,
            "metrics": {"loss": 0.5, "reward_mean": sum(rewards) / len(rewards)},
        }

    async def train_sft_events(
        self, model: art.TrainableModel, trajectories: list[art.Trajectory], config: art.SFTConfig
    ) -> AsyncIterator[dict[str, Any]]:
        self.sft.append(config)
        self.step += 1
        yield {"event": "done", "step": self.step, "metrics": {"loss": 1.0}}

    async def log(
        self,
        model: art.Model,
        groups: list[art.TrajectoryGroup],
        split: str = "val",
        *,
        metrics: dict[str, float] | None = None,
        step: int | None = None,
    ) -> dict[str, float]:
        from art_adapters.model_log import record_log

        directory = self.path / model.project / "models" / model.name
        return record_log(directory, groups, split, self.step if step is None else step, metrics)

    async def delete_checkpoints(
        self, model: art.TrainableModel, best_checkpoint_metric: str | None = None
    ) -> list[int]:
        return []

    async def close(self) -> None:
        pass


def groups() -> list[art.TrajectoryGroup]:
    return [art.TrajectoryGroup(art.Trajectory(reward=r) for r in (0.0, 1.0))]


@pytest.fixture
async def registered(tmp_path: Path) -> tuple[RecordingBackend, art.TrainableModel]:
    backend = RecordingBackend(tmp_path)
    model = art.TrainableModel(name="agent", project="compat", base_model="tiny")
    await model.register(backend)
    return backend, model


async def test_backend_train_maps_arts_keywords(
    registered: tuple[RecordingBackend, art.TrainableModel],
) -> None:
    backend, model = registered
    result = await backend.train(model, groups(), learning_rate=1e-5)
    assert isinstance(result, art.TrainResult) and result.step == 1 and result.metrics["loss"] == 0.5
    config, record = backend.steps[-1]
    assert not record  # ART >= 0.5.18: backend.train logs nothing; model.log does
    assert (config.loss, config.epsilon, config.clip_high, config.learning_rate) == ("cispo", 1.0, 4.0, 1e-5)

    await backend.train(model, groups(), loss_fn="ppo", epsilon=0.3, epsilon_high=0.28, scale_rewards=False)
    config, _ = backend.steps[-1]
    assert (config.loss, config.epsilon, config.clip_high, config.scale_rewards) == ("grpo", 0.3, 0.28, False)

    await backend.train(
        model, groups(), loss_fn="ppo", importance_sampling_level="sequence", kl_penalty_coef=0.1
    )
    config, _ = backend.steps[-1]
    assert (config.loss, config.normalization, config.beta) == ("gspo", "sequence", 0.1)

    await backend.train(model, groups(), normalize_advantages=False, logprob_calculation_chunk_size=256)
    assert backend.steps[-1][0].scale_rewards is False
    await backend.train(model, groups(), normalize_advantages=False, scale_rewards=True)  # either order
    assert backend.steps[-1][0].scale_rewards is False


@pytest.mark.parametrize("loss", ["grpo", "gspo", "cispo"])
async def test_backend_train_keeps_the_loss_its_config_chooses(
    registered: tuple[RecordingBackend, art.TrainableModel], loss: str
) -> None:
    """ART's CISPO default fills only what the config leaves unset: an explicit TrainConfig(loss=...) wins, and a
    keyword (ART's own way of choosing) still wins over both."""
    backend, model = registered
    await backend.train(model, groups(), config=art.TrainConfig(loss=loss))  # type: ignore[arg-type]
    config, _ = backend.steps[-1]
    published = {"grpo": (0.2, 0.2), "gspo": (3e-4, 4e-4), "cispo": (1.0, 4.0)}[loss]
    assert (config.loss, config.epsilon, config.clip_high) == (loss, *published)
    await backend.train(model, groups(), config=art.TrainConfig(learning_rate=1e-4))  # loss unset: ART's
    assert (backend.steps[-1][0].loss, backend.steps[-1][0].learning_rate) == ("cispo", 1e-4)
    await backend.train(model, groups(), config=art.TrainConfig(loss="grpo"), loss_fn="cispo")
    assert backend.steps[-1][0].loss == "cispo"


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"advantage_balance": 0.5}, "advantage_balance=0.5 is not supported"),
        ({"importance_sampling_level": "average"}, "'average' is not supported"),
        ({"loss_fn": "dro"}, "loss_fn must be"),
        ({"importance_sampling_level": "sequence"}, "needs the PPO clip"),
        ({"no_such_knob": 1}, "unknown ART setting 'no_such_knob'"),
        ({"save_checkpoint": False}, "save_checkpoint=False"),
    ],
)
async def test_unsupported_settings_are_clear_errors(
    registered: tuple[RecordingBackend, art.TrainableModel], setting: dict[str, Any], message: str
) -> None:
    backend, model = registered
    with pytest.raises(art.UnsupportedARTSetting, match=message):
        await backend.train(model, groups(), **setting)
    assert backend.steps == []  # refused before anything ran


async def test_model_train_with_config_and_dev_knobs(
    registered: tuple[RecordingBackend, art.TrainableModel], capsys: pytest.CaptureFixture[str]
) -> None:
    backend, model = registered
    metrics = await model.train(
        groups(),
        config=art.TrainConfig(learning_rate=2e-5, beta=0.05),
        _config=art.dev.TrainConfig(ppo=True, epsilon=0.25, scale_rewards=False),
        verbose=True,
    )
    assert metrics["loss"] == 0.5 and "'event': 'started'" in capsys.readouterr().out
    config, record = backend.steps[-1]
    assert record and (config.loss, config.epsilon, config.learning_rate, config.beta) == (
        "grpo",
        0.25,
        2e-5,
        0.05,
    )
    await model.train(groups(), config=art.TrainConfig(kl_penalty_coef=0.2))
    assert backend.steps[-1][0].beta == 0.2 and backend.steps[-1][0].loss == "grpo"
    with pytest.raises(art.UnsupportedARTSetting, match="mask_prob_ratio"):
        await model.train(groups(), _config={"mask_prob_ratio": True})
    with pytest.raises(ValueError, match="Extra inputs"):
        art.TrainConfig(learning_rate=1e-5, lr_schedule="cosine")


async def test_internal_config_and_register_options(
    registered: tuple[RecordingBackend, art.TrainableModel],
) -> None:
    backend, _ = registered
    model = art.TrainableModel(
        name="agent2",
        project="compat",
        base_model="tiny",
        _internal_config=art.dev.InternalModelConfig(
            init_args=art.dev.InitArgs(max_seq_length=512), trainer_args={"max_grad_norm": 0.5}
        ),
    )
    await model.register(backend, _openai_client_config=None)
    await model.train(groups())
    config, _ = backend.steps[-1]
    assert (config.max_seq_len, config.max_grad_norm) == (512, 0.5)
    await model.train(groups(), config=art.TrainConfig(max_seq_len=128))  # an explicit field wins
    assert backend.steps[-1][0].max_seq_len == 128
    # engine settings that cannot harm the host are this registration's; the rest are refused
    await model.register(backend, _openai_client_config={"engine_args": {"enforce_eager": True}})
    assert model.inference_settings() == {"enforce_eager": True}
    refused = [
        ({"engine_args": {"extra_args": ["--trust-remote-code"]}}, "engine_args \\['extra_args'\\]"),
        ({"server_args": {"tool_call_parser": "llama3_json"}}, "server_args"),
        ({"env": {"LD_PRELOAD": "/x.so"}}, "\\['env'\\] are not supported"),
    ]
    for config, message in refused:
        with pytest.raises(art.UnsupportedARTSetting, match=message):
            await model.register(backend, _openai_client_config=config)


async def test_train_sft_takes_arts_config(registered: tuple[RecordingBackend, art.TrainableModel]) -> None:
    backend, model = registered
    trajectories = [art.Trajectory(messages_and_choices=[{"role": "user", "content": "q"}])]
    await model.train_sft(
        trajectories, config=art.TrainSFTConfig(learning_rate=[1e-4, 5e-5], batch_size="auto")
    )
    config = backend.sft[-1]
    assert config.batch_size == 8 and config.rate(1, 2) == 5e-5
    with pytest.raises(ValueError, match="2 rates but the run has 3 batches"):
        config.rate(0, 3)


async def test_log_after_backend_train_as_art_does(
    registered: tuple[RecordingBackend, art.TrainableModel],
) -> None:
    backend, model = registered
    train_groups = groups()
    result = await backend.train(model, train_groups, learning_rate=1e-5)
    row = await model.log(train_groups, metrics=result.metrics, step=result.step, split="train")
    assert row["train/reward"] == 0.5 and row["train/loss"] == 0.5
    folder = backend.path / "compat" / "models" / "agent"
    assert (folder / "trajectories" / "train" / "0001.jsonl").exists()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, RecordingBackend]]:
    backend = RecordingBackend(tmp_path)
    with running(create_app(backend, api_key="key", allowed_base_models=["tiny"])) as url:
        yield url, backend


async def test_backend_train_through_the_server(served: tuple[str, RecordingBackend]) -> None:
    url, recorded = served
    backend = art.RemoteBackend(url, api_key="key")
    model = art.TrainableModel(name="agent", project="compat", base_model="tiny")
    await model.register(backend)
    result = await backend.train(model, groups(), learning_rate=3e-5, loss_fn="ppo")
    assert result.step == 1 and result.metrics["reward_mean"] == 0.5
    config, record = recorded.steps[-1]
    assert not record and (config.loss, config.learning_rate) == ("grpo", 3e-5)
    row = await model.log(groups(), metrics=result.metrics, step=result.step, split="train")
    assert row["train/loss"] == 0.5
    await backend.train(model, groups(), config=art.TrainConfig(loss="gspo"))
    assert recorded.steps[-1][0].loss == "gspo"
    await model.train(groups())
    assert recorded.steps[-1][1] is True
    await backend.close()
