"""Rollouts on Ray workers: each worker runs the async rollout in its own event loop and sends back Trajectory JSON;
the driver gets the same TrajectoryGroups `gather_trajectory_groups` returns. Ray is imported only when used.

Trust: Ray carries task arguments and results with pickle, so the driver unpickles what a worker returns (our
results are JSON strings, but the envelope is Ray's): whoever controls a worker, or may submit jobs to the cluster,
can run code in the driver. A Ray cluster is one trust domain with the driver. Workers hold only the inference key,
which cannot train, log or delete through the server."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import threading
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

from .backend.base import InferenceEndpoint
from .model import Model, TrainableModel
from .trajectories import PydanticException, RolloutError, Trajectory, TrajectoryGroup, exception_record

S = TypeVar("S")
RolloutFn = Callable[[Model, Any], Awaitable[Trajectory]]
RESOLVE_S = 5.0  # how long check_reachable waits on the resolver for an endpoint's host name


def _ray() -> Any:
    try:
        import ray
    except ImportError as error:  # pragma: no cover - depends on the install
        raise ImportError("gather_on_ray needs Ray: pip install 'art-adapters[ray]'") from error
    return ray


def model_spec(model: Model, step: int = 0) -> dict[str, Any]:
    """What a worker needs to run rollouts: the model's JSON, its inference endpoint (with the key that opens only
    `/v1/*` on a server started with `--inference-key`), and the step the driver is at. Never the backend's
    admin key: a rollout worker cannot train, log or delete."""
    endpoint = model._endpoint
    return {
        "trainable": isinstance(model, TrainableModel),
        "model": model.model_dump_json(),
        "endpoint": endpoint.model_dump_json() if endpoint is not None else None,
        "step": step,
    }


def check_reachable(model: Model, ray: Any) -> None:
    """Refuse an endpoint on this host's loopback when the cluster has other nodes: their workers would call their
    own 127.0.0.1 (a LocalBackend's gateway listens on loopback only)."""
    from urllib.parse import urlparse

    endpoint = model._endpoint
    if endpoint is None:
        return
    host = urlparse(endpoint.base_url).hostname or ""
    nodes = [node for node in ray.nodes() if node.get("Alive")]
    if len(nodes) > 1 and only_this_host(host):
        raise ValueError(
            f"the model's inference endpoint {endpoint.base_url} is on this host's loopback, which the other "
            f"{len(nodes) - 1} node(s) of the Ray cluster cannot reach: serve the backend on a routable address "
            "(`art-adapters serve --host 0.0.0.0 --api-key ... --inference-key ...`) and register the model "
            "through RemoteBackend(that address)"
        )


def only_this_host(host: str, resolve_s: float = RESOLVE_S) -> bool:
    """Whether `host` (a URL's host) reaches only the machine it is used on: a loopback or unspecified address in
    any form (`127.1`, `::ffff:127.0.0.1`, `0.0.0.0`, `[::]`), `localhost`, or a name that resolves (within
    `resolve_s`) to such addresses only. A name that does not resolve here is not judged (False)."""
    text = host.strip().strip("[]").rstrip(".").lower()
    if not text:
        return False
    if text == "localhost" or text.endswith(".localhost"):
        return True
    address = _literal(text)
    if address is not None:
        return _local(address)
    resolved = _resolve(text, resolve_s)
    return bool(resolved) and all(_local(a) for a in resolved)


def _literal(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """`text` as an address, short IPv4 forms included (`127.1`, `2130706433`: what a resolver would make of them)."""
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if not all(c.isalnum() or c == "." for c in text):
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(text))
    except OSError:
        return None


def _local(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback or address.is_unspecified


def _resolve(name: str, wait_s: float) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses `name` resolves to here ([] when it does not, or not within `wait_s`)."""
    found: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []

    def lookup() -> None:
        try:
            infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
        except (OSError, UnicodeError):
            return
        found.extend(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos)

    thread = threading.Thread(
        target=lookup, name="art-resolve", daemon=True
    )  # a stuck resolver is left behind
    thread.start()
    thread.join(wait_s)
    return [] if thread.is_alive() else list(found)


def rebuild_model(spec: dict[str, Any]) -> Model:
    """The worker's copy of the model: the same endpoint (token ids included); `get_step()` answers the driver's
    step at dispatch; training calls are refused."""
    cls = TrainableModel if spec["trainable"] else Model
    model = cls.model_validate_json(spec["model"])
    if spec["endpoint"] is not None:
        model._endpoint = InferenceEndpoint.model_validate_json(spec["endpoint"])
    model._backend = RolloutWorkerBackend(int(spec.get("step", 0)))  # type: ignore[assignment]
    return model


class RolloutWorkerBackend:
    """A rollout worker's backend: it knows the step its rollouts sample from, and nothing else."""

    def __init__(self, step: int) -> None:
        self.step = step

    async def get_step(self, model: Model) -> int:
        return self.step

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)

        def refused(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError(
                f"{name}: a Ray rollout worker only samples (it holds the inference key, not the backend's): "
                "train, log and manage checkpoints from the driver"
            )

        return refused

    async def close(self) -> None:
        return None


def run_rollouts(
    rollout_fn: RolloutFn, spec: dict[str, Any], scenario: Any, count: int
) -> list[dict[str, Any]]:
    """The Ray task: `count` rollouts of one scenario, concurrently in a fresh event loop. Each result is
    `{"trajectory": json}` or `{"error": exception_record}` (no pickled Trajectory crosses the wire)."""

    async def one(model: Model) -> dict[str, Any]:
        try:
            result = await rollout_fn(model, scenario)
        except Exception as error:
            return {"error": exception_record(error).model_dump()}
        if not isinstance(result, Trajectory):
            return {
                "error": exception_record(
                    TypeError(f"rollout returned {type(result).__name__}, not a Trajectory")
                ).model_dump()
            }
        return {"trajectory": result.model_dump_json()}

    async def main() -> list[dict[str, Any]]:
        model = rebuild_model(spec)
        try:
            return list(await asyncio.gather(*(one(model) for _ in range(count))))
        finally:
            if model._backend is not None:
                await model._backend.close()

    return asyncio.run(main())


async def gather_on_ray(
    rollout_fn: RolloutFn,
    scenarios: Iterable[S],
    group_size: int,
    *,
    model: Model,
    max_exceptions: int | float = 0,
    group_per_task: bool = False,
    max_in_flight: int | None = None,
    num_cpus: float = 1.0,
    remote_options: dict[str, Any] | None = None,
    address: str | None = None,
    pbar_desc: str | None = "gather (ray)",
) -> list[TrajectoryGroup]:
    """One TrajectoryGroup per scenario, in order, each of `group_size` rollouts `await rollout_fn(model, scenario)`
    run on Ray workers.

    The model travels as JSON with its inference endpoint only (reachable from the workers: in a cluster, serve
    the backend on a routable host with `--api-key` and `--inference-key`; workers get the inference key, which
    opens `/v1/*` alone, and `get_step()` answers the step at dispatch). `rollout_fn` and the scenarios travel by Ray's pickling, so they must be
    importable on the workers. `group_per_task=True` runs a whole group in one task (cheaper for I/O-bound
    agents); otherwise each rollout is its own task with `num_cpus`. `max_exceptions` as in
    `gather_trajectory_groups` (a count, or a fraction in (0, 1) of all rollouts); past it `RolloutError` is raised.
    `max_in_flight` bounds the tasks submitted at once. Ray is started locally (or joins `address`) if needed.
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, not {group_size}")
    if max_exceptions < 0:
        raise ValueError(f"max_exceptions must be >= 0, not {max_exceptions}")
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address, include_dashboard=False, ignore_reinit_error=True)
    check_reachable(model, ray)
    items: Sequence[S] = list(scenarios)
    step = await model.get_step() if isinstance(model, TrainableModel) and model._backend is not None else 0
    spec = ray.put(model_spec(model, step))
    task = ray.remote(run_rollouts).options(num_cpus=num_cpus, **(remote_options or {}))
    per_task = group_size if group_per_task else 1
    jobs = [(k, per_task) for k in range(len(items)) for _ in range(group_size // per_task)]
    bound = asyncio.Semaphore(max_in_flight) if max_in_flight else None
    total = len(items) * group_size
    pbar = _progress(pbar_desc, total)

    async def submit(index: int, count: int) -> tuple[int, list[dict[str, Any]]]:
        if bound is not None:
            await bound.acquire()
        try:
            results = await task.remote(rollout_fn, spec, items[index], count)
        except Exception as error:  # the task itself failed (worker died, scenario not picklable, ...)
            results = [{"error": exception_record(error).model_dump()}] * count
        finally:
            if bound is not None:
                bound.release()
        if pbar is not None:
            pbar.update(count)
        return index, results

    try:
        finished = await asyncio.gather(*(submit(k, n) for k, n in jobs))
    finally:
        if pbar is not None:
            pbar.close()
    groups = [TrajectoryGroup() for _ in items]
    for index, results in finished:
        for result in results:
            if "trajectory" in result:
                groups[index].trajectories.append(Trajectory.model_validate_json(result["trajectory"]))
            else:
                groups[index].exceptions.append(PydanticException.model_validate(result["error"]))
    failures = [e for g in groups for e in g.exceptions]
    allowed = max_exceptions * total if 0 < max_exceptions < 1 else max_exceptions
    if len(failures) > allowed:
        first = failures[0]
        raise RolloutError(
            f"{len(failures)} of {total} rollouts failed on Ray, more than max_exceptions={max_exceptions}; "
            f"first: {first.type}: {first.message}\n{first.traceback}"
        )
    return groups


def _progress(desc: str | None, total: int) -> Any:
    if desc is None:
        return None
    from .progress import progress_bar

    return progress_bar(total, desc, "rollout")
