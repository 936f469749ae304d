"""ART's shared-GPU order against a fake CUDA memory ledger (CPU): the engine sleeps, the allocator's cache is
emptied, the trainer comes back to the GPU, trains and saves, goes back to CPU, the cache is emptied again, and only
then the engine wakes and loads the adapter; a step that fails still wakes the engine with the memory released;
never two trainers on the device; at registration the trainer loads and offloads before the engine starts."""

from __future__ import annotations

import asyncio
import threading
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend import trainers
from art_adapters.backend.local import LocalBackend
from art_adapters.backend.serving import Registered
from art_adapters.inference import InferenceConfig
from art_adapters.tiny import tiny_model_path

GPU_GIB, ENGINE_GIB, TRAINER_GIB, ACTIVATIONS_GIB = 80, 60, 25, 15  # trainer + engine do not fit together


class Ledger:
    """One GPU's memory as the CUDA caching allocator sees it: the engine's share while awake (or starting), the
    weights of each trainer on the device, and the blocks the allocator caches until `empty_cache()`. Every event
    is checked: nothing may take memory that is not free, and never two trainers live at once."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.engine_holds = False
        self.on_gpu: set[int] = set()
        self.live: set[int] = set()
        self.cached = 0
        self.most_live = 0

    def used(self) -> int:
        return ENGINE_GIB * self.engine_holds + TRAINER_GIB * len(self.on_gpu) + self.cached

    def take(self, event: str, gib: int) -> None:
        assert self.used() + gib <= GPU_GIB, (
            f"{event}: {gib} GiB asked, {GPU_GIB - self.used()} free ({self.events})"
        )
        self.events.append(event)

    def note(self, event: str) -> None:
        self.events.append(event)

    def empty_cache(self) -> None:
        self.cached = 0
        self.events.append("empty_cache")


class FakeEngine:
    """The vLLM server: sleep (level 1) releases its memory, wake_up needs it free again."""

    def __init__(self, ledger: Ledger, gpu_ids: list[int] | None = None, running: bool = True) -> None:
        self.ledger = ledger
        self.config = InferenceConfig(gpu_ids=gpu_ids)
        self.running = running
        ledger.engine_holds = running

    async def start(self) -> FakeEngine:
        self.ledger.take("start", ENGINE_GIB)
        self.ledger.engine_holds = self.running = True
        return self

    async def sleep(self) -> None:
        self.ledger.engine_holds = False
        self.ledger.note("sleep")

    async def wake_up(self) -> None:
        self.ledger.take("wake", ENGINE_GIB)
        self.ledger.engine_holds = True


class FakeGateway:
    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    async def publish(self, key: str, name: str, step: int, path: Path) -> str:
        assert self.ledger.engine_holds, "an adapter loaded into a sleeping engine"
        self.ledger.note("load_adapter")
        return f"{key}@{step}"

    async def moved(self, key: str, old: int, path: Path) -> None: ...


class FakeTrainer:
    """Loads onto the GPU, offloads, reloads, trains (its activations stay cached), saves, closes."""

    def __init__(self, ledger: Ledger, step: int = 0, fail: str | None = None) -> None:
        ledger.take("load", TRAINER_GIB)
        ledger.on_gpu.add(id(self))
        ledger.live.add(id(self))
        ledger.most_live = max(ledger.most_live, len(ledger.live))
        self.ledger, self.step, self.fail, self.alive = ledger, step, fail, True
        self.gate: threading.Event | None = None
        self.training = threading.Event()

    def offload(self) -> None:
        if id(self) in self.ledger.on_gpu:
            self.ledger.on_gpu.discard(id(self))
            self.ledger.cached += TRAINER_GIB  # freed blocks stay in the allocator's cache
            self.ledger.note("offload")

    def reload(self) -> None:
        if id(self) not in self.ledger.on_gpu:
            self.ledger.take("reload", TRAINER_GIB)
            self.ledger.on_gpu.add(id(self))

    def close(self) -> None:
        if id(self) in self.ledger.on_gpu:
            self.ledger.on_gpu.discard(id(self))
            self.ledger.cached += TRAINER_GIB
        self.ledger.live.discard(id(self))
        self.ledger.empty_cache()  # Trainer.close frees for real
        self.ledger.note("close")

    def train_step(self, groups: Any, config: Any) -> dict[str, Any]:
        assert id(self) in self.ledger.on_gpu, "trained while offloaded"
        self.ledger.take("train", ACTIVATIONS_GIB)
        self.ledger.cached += ACTIVATIONS_GIB
        self.training.set()
        if self.gate is not None:
            self.gate.wait(30)
        if self.fail == "before":
            raise RuntimeError("out of memory in the forward")
        self.step += 1
        if self.fail == "after":
            raise RuntimeError("failed after the update")
        return {"loss": 0.5}

    def sft_step(self, batch: Any, config: Any) -> dict[str, Any]:
        assert id(self) in self.ledger.on_gpu and not self.ledger.engine_holds, (
            "SFT off the GPU or beside the engine"
        )
        self.ledger.note("sft")
        self.sft_batches = getattr(self, "sft_batches", 0) + 1
        self.training.set()
        if self.gate is not None and self.sft_batches == 2:
            self.gate.wait(30)
        if self.fail == f"sft batch {self.sft_batches}":
            raise RuntimeError("out of memory in the forward")
        return {"loss": 1.0 / self.sft_batches, "trained_tokens": 3}

    def save(self, directory: Path) -> Path:
        assert id(self) in self.ledger.on_gpu or self.ledger.engine_holds is False
        self.ledger.note("save")
        (directory / "adapter_config.json").write_text("{}")
        return directory


def shared_state(tmp_path: Path, ledger: Ledger, trainer: FakeTrainer | None) -> Registered:
    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path()))
    return Registered(
        model=model,
        directory=tmp_path,
        server=FakeEngine(ledger),  # type: ignore[arg-type]
        gateway=FakeGateway(ledger),  # type: ignore[arg-type]
        trainer=trainer,  # type: ignore[arg-type]
        step=trainer.step if trainer else 0,
        lock=asyncio.Lock(),
    )


@pytest.fixture
def ledger(monkeypatch: pytest.MonkeyPatch) -> Ledger:
    book = Ledger()
    monkeypatch.setattr(torch.cuda, "empty_cache", book.empty_cache)
    return book


def offloaded(ledger: Ledger, step: int = 0, **kwargs: Any) -> FakeTrainer:
    """A trainer as registration leaves it on a shared GPU: loaded, then on the CPU."""
    ledger.engine_holds = False
    trainer = FakeTrainer(ledger, step, **kwargs)
    trainer.offload()
    ledger.empty_cache()
    ledger.events.clear()
    return trainer


def step_of(backend: LocalBackend, state: Registered) -> Any:
    return backend._run_trainer(state, lambda t: t.train_step(None, None), save=lambda m: False)


async def test_a_step_runs_in_arts_order(tmp_path: Path, ledger: Ledger) -> None:
    state = shared_state(tmp_path, ledger, offloaded(ledger))
    backend = LocalBackend(tmp_path / "art")
    for step in (1, 2):
        ledger.events.clear()
        assert await step_of(backend, state) == {"loss": 0.5}
        assert ledger.events == [
            "sleep",
            "empty_cache",
            "reload",
            "train",
            "save",
            "offload",
            "empty_cache",
            "wake",
            "load_adapter",
        ]
        assert state.step == step and checkpoints.list_steps(tmp_path) == list(range(1, step + 1))
    assert ledger.engine_holds and not ledger.on_gpu and ledger.cached == 0 and ledger.most_live == 1


@pytest.mark.parametrize("where", ["before", "after"])
async def test_a_failed_step_still_wakes_the_engine_with_the_memory_released(
    tmp_path: Path, ledger: Ledger, where: str
) -> None:
    trainer = offloaded(ledger, fail=where)
    state = shared_state(tmp_path, ledger, trainer)
    with pytest.raises(RuntimeError, match="out of memory|after the update"):
        await step_of(LocalBackend(tmp_path / "art"), state)
    assert ledger.events[-1] == "wake" and ledger.events[-2] == "empty_cache"
    assert ledger.engine_holds and not ledger.on_gpu and ledger.cached == 0
    if where == "before":  # nothing moved: the trainer stays, on the CPU
        assert state.trainer is trainer and "offload" in ledger.events
    else:  # weights no checkpoint holds: closed, the next step reloads from disk
        assert state.trainer is None and not ledger.live and "close" in ledger.events
    assert state.step == 0 and "save" not in ledger.events


async def test_recovery_closes_the_old_trainer_before_loading_the_new(tmp_path: Path, ledger: Ledger) -> None:
    backend = LocalBackend(tmp_path / "art")
    loads: list[FakeTrainer] = []

    def load(model: Any, directory: Path) -> FakeTrainer:
        loads.append(FakeTrainer(ledger, max(checkpoints.list_steps(directory), default=0)))
        return loads[-1]

    backend._load_trainer = load  # type: ignore[method-assign]
    stale = offloaded(ledger, step=3)  # a step left unsaved: the trainer is ahead of the disk
    state = shared_state(tmp_path, ledger, stale)
    state.step = 0
    await step_of(backend, state)
    assert ledger.events.index("close") < ledger.events.index("load") and ledger.most_live == 1
    assert state.step == 1 and len(loads) == 1
    dead = state.trainer
    assert dead is not None
    dead.alive = False  # a trainer that died (a sharded one's process): replaced, the old one closed first
    ledger.events.clear()
    await step_of(backend, state)
    assert ledger.events.index("close") < ledger.events.index("load") and ledger.most_live == 1
    assert state.step == 2 and ledger.events[:2] == ["sleep", "empty_cache"]  # loaded with the engine asleep


async def test_a_cancelled_step_wakes_the_engine_once_its_thread_ends(tmp_path: Path, ledger: Ledger) -> None:
    trainer = offloaded(ledger)
    trainer.gate = threading.Event()
    state = shared_state(tmp_path, ledger, trainer)
    task = asyncio.ensure_future(step_of(LocalBackend(tmp_path / "art"), state))
    assert await asyncio.to_thread(trainer.training.wait, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task  # the caller returns at once
    assert not ledger.engine_holds and state.trainer is None  # still training: the engine waits
    trainer.gate.set()
    assert state.abandoned is not None
    await state.abandoned
    assert ledger.events[-3:] == ["close", "empty_cache", "wake"] and not ledger.live and ledger.cached == 0


async def test_registration_loads_and_offloads_the_trainer_before_the_engine_starts(
    tmp_path: Path, ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trainers, "cuda_devices", lambda: 1)
    backend = LocalBackend(tmp_path / "art")
    backend._load_trainer = lambda model, directory: FakeTrainer(ledger)  # type: ignore[method-assign,assignment]
    model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path()))
    engine = FakeEngine(ledger, running=False)
    trainer = await backend._start(engine, model, tmp_path)  # type: ignore[arg-type]
    assert ledger.events == ["load", "offload", "empty_cache", "start"]
    second = FakeEngine(ledger, running=True)  # a second model on a running engine: loaded while it sleeps
    ledger.events.clear()
    trainer.close()
    ledger.events.clear()
    await backend._start(second, model, tmp_path)  # type: ignore[arg-type]
    assert ledger.events == ["sleep", "empty_cache", "load", "offload", "empty_cache", "wake"]


async def test_registration_overlaps_the_loads_on_the_cpu_and_on_gpus_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    both = asyncio.Event()
    started: list[str] = []

    class Engine:
        config = InferenceConfig(gpu_ids=[1])
        running = False

        async def start(self) -> None:
            started.append("start")
            await asyncio.wait_for(both.wait(), 10)  # returns only once the trainer's load ran beside it

    def load(model: Any, directory: Path) -> str:
        started.append("load")
        both.set()
        return "trainer"

    for devices, gpus in ((0, []), (2, [0])):
        monkeypatch.setattr(trainers, "cuda_devices", lambda d=devices: d)
        backend = LocalBackend(tmp_path, trainer_gpu_ids=gpus)
        backend._load_trainer = load  # type: ignore[method-assign,assignment]
        both.clear()
        started.clear()
        model = art.TrainableModel(name="m", project="p", base_model=str(tiny_model_path()))
        assert await backend._start(Engine(), model, tmp_path) == "trainer"  # type: ignore[arg-type]
        assert sorted(started) == ["load", "start"]


def test_a_trainer_moves_its_state_and_close_frees_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from art_adapters.training import trainer_parts as trainer_module
    from art_adapters.training.trainer import Trainer

    trainer = Trainer(tiny_model_path(), art.LoRAConfig(rank=4), engine="peft")
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    trainer.optimizer.state[params[0]]["exp_avg"] = torch.ones_like(params[0])
    before = {id(t): t.data_ptr() for t in [*trainer.model.parameters(), *trainer.model.buffers()]}
    trainer.offload()  # on the CPU: nothing to move
    assert all(t.data_ptr() == before[id(t)] for t in trainer.model.parameters())
    moved: list[str] = []

    def move(tensor: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
        moved.append(device.type)
        return tensor.clone()  # a copy "on the other device" (CPU torch has one device)

    monkeypatch.setattr(trainer_module, "_moved", move)
    trainer._move_state(torch.device("cuda"))  # every tensor moves; parameters keep their identity
    tensors = [*trainer.model.parameters(), *trainer.model.buffers()]
    assert all(t.data_ptr() != before[id(t)] for t in tensors)
    assert len(moved) == len(tensors) + 1  # and the optimizer's state
    assert trainer.optimizer.param_groups[0]["params"][0] is params[0]
    model = weakref.ref(trainer.model)
    del params, tensors
    trainer.close()
    assert model() is None and trainer.step == 0  # no reference left: the memory is free
