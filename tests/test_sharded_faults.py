"""A sharded trainer under faults and strangers, with real processes and gloo: a rank that raises, one SIGKILLed and
one that hangs each make the step raise within 60 s, `close()` returns within 10 s even with a call in flight, and
the backend's next call replaces the dead trainer from the last checkpoint. One host listens on no network
interface; a second host joins only with the token, and one started differently is refused by name."""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import art_adapters as art
from art_adapters import checkpoints
from art_adapters.backend.serving import Registered
from art_adapters.backend.trainers import TrainerHost, trainer_gpus
from art_adapters.config import LoRAConfig, ShardedTrainerOptions, TrainConfig
from art_adapters.tiny import tiny_model_path
from art_adapters.training import launcher
from art_adapters.training.rendezvous import TOKEN_ENV
from art_adapters.training.sharded import ShardedTrainer, TrainerProcessError
from test_sharded_training import HEAD, LR
from test_trainer import rollouts

pytestmark = pytest.mark.train
TESTS = str(Path(__file__).parent)
FAST = ShardedTrainerOptions(collective_timeout_s=8.0, heartbeat_timeout_s=20.0)


class _Server:
    """The engine a step would put to sleep (none here: the trainer is what is tested)."""

    class config:  # noqa: N801
        gpu_ids = None

    async def sleep(self) -> None: ...

    async def wake_up(self) -> None: ...


class _Gateway:
    def __init__(self) -> None:
        self.published: list[int] = []

    async def publish(self, key: str, name: str, step: int, path: Path) -> str:
        self.published.append(step)
        return f"{key}@{step}"


class Host(TrainerHost):
    """LocalBackend's trainer management (the code under test) without its vLLM server."""

    def __init__(self) -> None:
        self.trainer_gpu_ids: list[int] = []
        self.trainer_processes = 2
        self.trainer_nodes = 1
        self.trainer_master = None
        self.trainer_options = FAST
        self._models = {}


@pytest.fixture
def faults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Trainers started now run tests/fault_worker.py; writing `KIND RANK OP` to the returned file arms a fault."""
    monkeypatch.setattr(launcher, "WORKER_MODULE", "fault_worker")
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p)
    )
    path = tmp_path / "fault"
    monkeypatch.setenv("ART_TEST_FAULT_FILE", str(path))
    return path


async def test_each_fault_raises_and_the_next_call_replaces_the_trainer(faults: Path, tmp_path: Path) -> None:
    model = art.TrainableModel(name="f", project="p", base_model=str(tiny_model_path()), lora=HEAD)
    state = Registered(model, tmp_path / "model", _Server(), _Gateway(), None, 0, asyncio.Lock())  # type: ignore[arg-type]
    host = Host()
    config = TrainConfig(learning_rate=LR, micro_batch_tokens=64)
    batches = {seed: rollouts(single_trainer(), seed=seed) for seed in (1, 2)}

    async def step(seed: int) -> dict[str, Any]:
        return await host._run_trainer(
            state, lambda t: t.train_step(batches[seed], config), save=lambda m: "skipped_reason" in m
        )

    first = await host._live_trainer(state)
    assert (await step(1))["trainer_processes"] == 2 and state.step == 1
    trainers = [first]
    for kind in ("raise", "kill", "hang"):
        await asyncio.to_thread(faults.write_text, f"{kind} 1 train_step")
        started = time.monotonic()
        with pytest.raises(TrainerProcessError) as raised:
            await step(2)
        elapsed = time.monotonic() - started
        print(f"fault {kind!r} on rank 1: the step raised after {elapsed:.1f} s")
        assert elapsed < 60, kind
        assert {"raise": "injected fault on rank 1", "kill": "rank 1 exited with signal 9", "hang": "exited"}[
            kind
        ] in str(raised.value)
        assert state.trainer is None and not trainers[-1].alive and state.step == 1  # dropped; nothing saved
        assert all(p.poll() is not None for p in trainers[-1]._ranks.processes.values())  # none left behind
        replaced = await host._live_trainer(state)  # the next call: a new trainer from checkpoint 0001
        assert replaced is not trainers[-1] and replaced.step == 1
        trainers.append(replaced)
    metrics = await step(2)  # the fourth trainer trains on from step 1
    assert state.step == 2 and metrics["trained_tokens"] > 0
    assert checkpoints.list_steps(state.directory) == [0, 1, 2]
    trainers[-1].close()


def test_close_returns_within_seconds_while_a_rank_hangs_in_a_call(faults: Path) -> None:
    trainer = ShardedTrainer(tiny_model_path(), HEAD, processes=2, options=ShardedTrainerOptions())
    groups = rollouts_for(trainer)
    faults.write_text("hang 1 train_step")
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            trainer.train_step(groups, TrainConfig(learning_rate=LR))
        except BaseException as error:
            outcome.append(error)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(2.0)  # rank 1 hangs; the leader waits in a collective (60 s timeout: longer than this test)
    started = time.monotonic()
    trainer.close()
    print(f"close() with rank 1 hung in a call returned after {time.monotonic() - started:.2f} s")
    assert time.monotonic() - started < 10
    thread.join(10)
    assert not thread.is_alive() and isinstance(outcome[0], TrainerProcessError)
    assert "closed" in str(outcome[0])
    with pytest.raises(TrainerProcessError, match="closed"):
        trainer.logprobs_of([1, 2, 3])


def rollouts_for(trainer: ShardedTrainer) -> list[art.TrajectoryGroup]:
    return rollouts(single_trainer(), seed=4)


def single_trainer() -> Any:
    from art_adapters.training.trainer import Trainer

    return Trainer(tiny_model_path(), HEAD, engine="peft")


def test_one_host_listens_on_no_network_interface() -> None:
    """A single host's processes meet through a FileStore in a private folder; gloo binds loopback only."""
    trainer = ShardedTrainer(tiny_model_path(), HEAD, processes=2, engine="peft")
    try:
        assert trainer.logprobs_of([5, 6, 7])
        listening = [
            (rank, c.laddr.ip)
            for rank, process in trainer._ranks.processes.items()
            for c in psutil.Process(process.pid).net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN
        ]
        assert listening and all(ip in ("127.0.0.1", "::1") for _, ip in listening), listening
        assert oct(trainer._folder.stat().st_mode & 0o777) == "0o700"
    finally:
        trainer.close()


def test_gpu_selection() -> None:
    """trainer_processes=N on a CUDA host takes GPUs 0..N-1 unless told; no GPUs: the CPU."""
    assert trainer_gpus(2, [], cuda_devices=4) == [0, 1]
    assert trainer_gpus(2, [2, 3], cuda_devices=4) == [2, 3]
    assert trainer_gpus(2, [], cuda_devices=0) == []
    assert trainer_gpus(1, [], cuda_devices=4) == []  # one process: Trainer picks cuda itself
    with pytest.raises(ValueError, match="needs 4 GPUs and this host has 2"):
        trainer_gpus(4, [], cuda_devices=2)
    with pytest.raises(ValueError, match="needs as many trainer GPU ids"):
        trainer_gpus(2, [0], cuda_devices=4)


# --- several hosts -------------------------------------------------------------------------------------------------


def free_master() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


class Joined:
    """Node 0 (a ShardedTrainer started in a thread) and node 1 started from the command node 0 logs, as a user
    would paste it on the other host (`art-adapters` run as this interpreter's module)."""

    def __init__(self, caplog: pytest.LogCaptureFixture, node1_env: dict[str, str], edit: Any = None) -> None:
        self.master = free_master()
        self.result: list[Any] = []
        with caplog.at_level(logging.INFO, logger="art_adapters.training.sharded"):
            thread = threading.Thread(target=self._start, daemon=True)
            thread.start()
            deadline = time.monotonic() + 60
            while not any("on host 1 run:" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline and thread.is_alive()
                time.sleep(0.05)
        line = next(r.getMessage() for r in caplog.records if "on host 1 run:" in r.getMessage())
        argv = shlex.split(line.split("on host 1 run: ", 1)[1])
        assert argv[:2] == ["art-adapters", "trainer-worker"] and f"with {TOKEN_ENV} set" in line
        argv = [sys.executable, "-m", "art_adapters.cli", *argv[1:]]
        if edit is not None:
            argv = edit(argv)
        self.joiner = subprocess.Popen(argv, env=node1_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        thread.join(180)
        assert not thread.is_alive()

    def _start(self) -> None:
        try:
            self.result.append(
                ShardedTrainer(
                    tiny_model_path(),
                    HEAD,
                    processes=1,
                    nodes=2,
                    master=self.master,
                    engine="peft",
                    options=ShardedTrainerOptions(hsdp=True, collective_timeout_s=30),
                )
            )
        except BaseException as error:
            self.result.append(error)

    def node1_output(self) -> str:
        try:
            return self.joiner.communicate(timeout=60)[0].decode()
        finally:
            if self.joiner.poll() is None:
                self.joiner.kill()


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv(TOKEN_ENV, "s3cret-join-token")
    return "s3cret-join-token"


def test_a_second_host_joins_with_the_logged_command_and_trains_as_one_process(
    token: str, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """HSDP over two "hosts" (replicate across, shard within); the step equals one process's."""
    from art_adapters.training.trainer import Trainer
    from test_sharded_training import assert_same_adapter

    joined = Joined(caplog, {**os.environ})
    sharded = joined.result[0]
    assert isinstance(sharded, ShardedTrainer), sharded
    try:
        single = Trainer(tiny_model_path(), HEAD, engine="peft")
        single.save(tmp_path / "start")
        sharded.load(tmp_path / "start")
        groups = rollouts(single, seed=11)
        config = TrainConfig(learning_rate=LR, micro_batch_tokens=64)
        one, two = single.train_step(groups, config), sharded.train_step(groups, config)
        assert two["trainer_processes"] == 2 and two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-7)
        single.save(tmp_path / "one")
        sharded.save(tmp_path / "two")
        assert_same_adapter(tmp_path / "one", tmp_path / "two")
    finally:
        sharded.close()
    assert joined.joiner.wait(timeout=60) == 0  # node 1 ends with the trainer


def test_a_host_without_the_token_or_started_differently_is_refused_by_name(
    token: str, caplog: pytest.LogCaptureFixture
) -> None:
    stranger = Joined(caplog, {**os.environ, TOKEN_ENV: "a-guess"})
    error = stranger.result[0]
    assert isinstance(error, TrainerProcessError) and "rank 1 (node 1) did not prove" in str(error)
    stranger.node1_output()
    caplog.clear()

    def other_lora(argv: list[str]) -> list[str]:
        return [
            LoRAConfig(rank=4).model_dump_json().join(("--lora=", "")) if a.startswith("--lora=") else a
            for a in argv
        ]

    different = Joined(caplog, {**os.environ}, edit=other_lora)
    error = different.result[0]
    assert isinstance(
        error, TrainerProcessError
    ) and "rank 1 (node 1) was started with a different LoRA config" in str(error)
    different.node1_output()


def test_several_hosts_need_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ValueError, match=f"needs a join token: set {TOKEN_ENV}"):
        ShardedTrainer(tiny_model_path(), HEAD, processes=1, nodes=2, master=free_master())
    joined = subprocess.run(
        [sys.executable, "-m", "art_adapters.cli", "trainer-worker", "--nodes=2", "--node-rank=1",
         f"--master={free_master()}", f"--base-model={tiny_model_path()}"],
        capture_output=True, text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != TOKEN_ENV},
    )  # fmt: skip
    assert joined.returncode != 0 and "needs a join token" in joined.stderr


def test_a_frozen_leader_is_declared_dead_when_its_heartbeat_stops() -> None:
    """Rank 0 stopped (SIGSTOP: alive, silent, holding its peers): no heartbeat, so the call raises."""
    import signal

    options = ShardedTrainerOptions(heartbeat_timeout_s=4.0)
    trainer = ShardedTrainer(tiny_model_path(), HEAD, processes=2, engine="peft", options=options)
    try:
        trainer._ranks.processes[0].send_signal(signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TrainerProcessError, match="sent no heartbeat for 4 s"):
            trainer.logprobs_of([5, 6, 7])
        print(f"a frozen leader: the call raised after {time.monotonic() - started:.1f} s")
        assert time.monotonic() - started < 15 and not trainer.alive
    finally:
        trainer.close()
    assert all(p.poll() is not None for p in trainer._ranks.processes.values())


def _declare_too_much(store: str, out: str) -> None:
    import torch.distributed as dist

    from art_adapters.training.parallel import Parallel, all_gather_bytes

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        parallel = Parallel(rank=0, world=1, local_rank=0, nodes=1, mesh=None, control=dist.group.WORLD)
        try:
            all_gather_bytes(b"x" * 100, parallel, limit=32)
        except ConnectionError as error:
            Path(out).write_text(str(error))
    finally:
        dist.destroy_process_group()


def test_the_join_refuses_a_declared_length_before_allocating_for_it(tmp_path: Path) -> None:
    """Before a peer has proved the token, a length it declares past what the join exchanges is refused by every
    process alike (a stranger at the master port could otherwise make every host allocate what it asks)."""
    import multiprocessing

    out = tmp_path / "error.txt"
    process = multiprocessing.get_context("spawn").Process(
        target=_declare_too_much, args=(str(tmp_path / "store"), str(out))
    )
    process.start()
    process.join(120)
    assert process.exitcode == 0 and "rank 0 declared 100 bytes where at most 32" in out.read_text()
