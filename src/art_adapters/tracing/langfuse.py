"""Langfuse exporter: one trace per trajectory (agent root, a generation per LLM call, tools, reward scores; a call's
own reward is a `reward` score on its generation).

The work runs on a daemon thread behind a bounded queue, so a slow, dead or failing Langfuse never slows or
breaks training: `export()` only enqueues, `flush()`/`close()` wait at most their timeout, errors become warnings.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import secrets
import threading
import time
import warnings
from typing import Any, Literal

from ..trajectories import TrajectoryGroup
from ._convert import Obs, TracePlan, new_trace_id, plan_trace
from ._dedupe import OURS, HandlerGenerations, install_recorder
from ._records import CALL_KEY, SKIPPED_CALLS_KEY
from ._sdk import ErrorCounter, Exportable, Unreachable, flatten, quietly
from .langfuse_import import ImportStats, TraceImport, import_trajectories

log = logging.getLogger(__name__)


class LangfuseExporter:
    """Send trajectories to Langfuse as traces.

    `export(groups, step=3, split="train")` enqueues and returns the trace ids at once; `exporter.after_each` is a
    ready `after_each` hook for `gather_trajectory_groups` (returns the group unchanged, uses `exporter.step` and
    `exporter.split`). Keys and URL fall back to LANGFUSE_PUBLIC_KEY, LANGFUSE_SECRET_KEY and
    LANGFUSE_BASE_URL / LANGFUSE_HOST.

    `skip_generations`: "auto" (default) leaves out the generations that Langfuse's own LangChain
    `CallbackHandler` (or any other Langfuse instrumentation on the same key) already sent for the same call,
    matched by model and time window, and links them in the root's metadata; True leaves out every generation;
    False sends all. Make the exporter before the rollouts run, so it sees the handler's generations.

    `training_data` (default True): each generation also carries its call's training record (token ids, sampled
    logprobs, policy version, served model, source; packed, about 8 bytes per token, see docs/production.md)
    and the root the trajectory's, so `import_trajectories` gives back the Trajectory it was. False sends only
    what people read.
    """

    def __init__(
        self,
        public_key: str | None = None,
        secret_key: str | None = None,
        base_url: str | None = None,
        *,
        session_id: str | None = None,
        project: str | None = None,
        tags: list[str] | None = None,
        timeout_s: float = 3.0,
        max_queue: int = 10_000,
        skip_generations: bool | Literal["auto"] = "auto",
        training_data: bool = True,
    ) -> None:
        self.timeout_s = timeout_s
        self.training_data = training_data
        self.project = project
        self.tags = list(tags or [])
        self.session_id = session_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"
        self.skip_generations = skip_generations
        self.step: int | None = None
        self.split: str | None = "train"
        self.exported = 0
        self.dropped = 0
        self.failed = 0
        self.skipped_generations = 0
        self._group_counter: dict[tuple[int | None, str | None], int] = {}
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._closed = False
        self._last_warning = 0.0
        self._sdk_thread: threading.Thread | None = None
        self._errors = ErrorCounter()
        self._handler_generations: HandlerGenerations | None = None
        self._unreachable = Unreachable(self._say_unreachable, "Langfuse")
        self._client = self._make_client(public_key, secret_key, base_url)
        self._worker = threading.Thread(target=self._run, name="art-langfuse-export", daemon=True)
        self._worker.start()
        atexit.register(self._atexit)

    # -- client ---------------------------------------------------------------------------------------------
    def _make_client(self, public_key: str | None, secret_key: str | None, base_url: str | None) -> Any:
        public_key = public_key or os.environ.get("LANGFUSE_PUBLIC_KEY")
        secret_key = secret_key or os.environ.get("LANGFUSE_SECRET_KEY")
        base_url = base_url or os.environ.get("LANGFUSE_BASE_URL") or os.environ.get("LANGFUSE_HOST")
        if not public_key or not secret_key:
            self._warn(
                "Langfuse export disabled: no public/secret key (set LANGFUSE_PUBLIC_KEY/LANGFUSE_SECRET_KEY)"
            )
            return None
        try:
            from langfuse import Langfuse
        except ImportError:
            self._warn("Langfuse export disabled: `pip install langfuse` (or art-adapters[langfuse])")
            return None
        try:
            client = Langfuse(
                public_key=public_key,
                secret_key=secret_key,
                base_url=base_url,
                timeout=max(1, round(self.timeout_s)),
            )
        except Exception as error:  # a bad setting must not stop training
            self._warn(f"Langfuse export disabled: client failed to start: {error!r}")
            return None
        logging.getLogger("langfuse").addHandler(self._errors)
        self._unreachable.url = base_url or "Langfuse"
        self._unreachable.install()
        if self.skip_generations == "auto":
            self._handler_generations = install_recorder(client)
        return client

    @property
    def client(self) -> Any:
        """The underlying `langfuse.Langfuse` client (None when export is disabled)."""
        return self._client

    # -- public API -----------------------------------------------------------------------------------------
    def export(
        self,
        items: Exportable,
        *,
        step: int | None = None,
        split: str | None = None,
        group_index: int | None = None,
    ) -> list[str]:
        """Enqueue trajectories (one, a group, or a list of either) and return their trace ids; never blocks."""
        step = self.step if step is None else step
        split = self.split if split is None else split
        trace_ids: list[str] = []
        for gi, ti, trajectory in flatten(items, group_index):
            trace_id = new_trace_id()
            job = (trajectory, trace_id, step, split, gi, ti)
            if self._closed or self._client is None:
                continue
            try:
                self._queue.put_nowait(job)
                trace_ids.append(trace_id)
            except queue.Full:
                self.dropped += 1
                self._warn(
                    f"Langfuse export queue full ({self._queue.maxsize}): dropped {self.dropped} trajectories"
                )
        return trace_ids

    def after_each(self, group: TrajectoryGroup) -> TrajectoryGroup:
        """`gather_trajectory_groups(..., after_each=exporter.after_each)`: export the group, return it unchanged."""
        key = (self.step, self.split)
        index = self._group_counter.get(key, 0)
        self._group_counter[key] = index + 1
        self.export(group, group_index=index)
        return group

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything exported so far has been sent, at most `timeout_s`; False (and a warning) if not."""
        if self._client is None:
            return True
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        done = threading.Event()
        try:
            self._queue.put(done, timeout=max(timeout, 0.001))
        except queue.Full:
            self._warn(f"Langfuse flush gave up after {timeout:.1f}s: export queue still full")
            return False
        if not done.wait(max(deadline - time.monotonic(), 0.0)):
            self._warn(f"Langfuse flush gave up after {timeout:.1f}s: trajectories still being converted")
            return False
        ok = self._sdk_call(self._client.flush, max(deadline - time.monotonic(), 0.0), "flush")
        errors = self._errors.take()
        if errors or self._unreachable.failures:
            if not self._unreachable.said and errors:  # an unreachable Langfuse was already said, once
                self._warn(f"Langfuse reported {len(errors)} export error(s); last: {errors[-1]}")
            return False
        return ok

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (bounded), stop the worker and shut the SDK client down (bounded too)."""
        if self._closed:
            return
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        self.flush(timeout)
        self._closed = True
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        if self._client is not None:
            # a fresh thread: the SDK's shutdown unregisters its own atexit hook first, which would block exit
            self._sdk_call(
                self._client.shutdown, max(deadline - time.monotonic(), 0.05), "shutdown", fresh=True
            )
        logging.getLogger("langfuse").removeHandler(self._errors)
        atexit.unregister(self._atexit)

    def __enter__(self) -> LangfuseExporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- worker ---------------------------------------------------------------------------------------------
    def _say_unreachable(self, url: str) -> None:
        log.warning(
            "Langfuse at %s is not answering: traces are not sent until it does (training is not affected; "
            "further export failures are not printed)",
            url,
        )

    def _atexit(self) -> None:
        self.close(min(self.timeout_s, 2.0))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            trajectory, trace_id, step, split, gi, ti = job
            try:
                plan = plan_trace(
                    trajectory,
                    trace_id=trace_id,
                    step=step,
                    split=split,
                    group_index=gi,
                    trajectory_index=ti,
                    project=self.project,
                    session_id=self.session_id,
                    tags=self.tags,
                    training_data=self.training_data,
                )
                self._emit(plan)
                self.exported += 1
            except Exception as error:  # never let one bad trajectory stop the exporter
                self.failed += 1
                self._warn(f"Langfuse export of one trajectory failed: {error!r}")

    def _emit(self, plan: TracePlan) -> None:
        from langfuse import (
            LangfuseAgent,
            LangfuseChain,
            LangfuseGeneration,
            LangfuseSpan,
            LangfuseTool,
            propagate_attributes,
        )
        from opentelemetry import trace as otel

        classes = {
            "agent": LangfuseAgent,
            "chain": LangfuseChain,
            "generation": LangfuseGeneration,
            "tool": LangfuseTool,
        }
        children = self._dedupe(plan)
        # the SDK's own tracer, so our spans go through its processor, exporter, masking and sampling
        tracer = self._client._otel_tracer
        parent = otel.NonRecordingSpan(
            otel.SpanContext(
                trace_id=int(plan.trace_id, 16),
                span_id=int(secrets.token_hex(8), 16) or 1,
                is_remote=False,
                trace_flags=otel.TraceFlags(0x01),
            )
        )
        with propagate_attributes(
            session_id=plan.session_id,
            tags=plan.tags or None,
            metadata=plan.trace_metadata or None,
            trace_name=plan.trace_name,
        ):
            root_span = tracer.start_span(
                plan.root.name,
                context=otel.set_span_in_context(parent),
                start_time=plan.root.start_ns,
                attributes={"langfuse.internal.as_root": True, OURS: True},
            )
            root = self._wrap(LangfuseAgent, root_span, plan.root)
            contexts = {None: otel.set_span_in_context(root_span)}
            opened: list[tuple[Any, Obs]] = []
            call_scores: list[tuple[str, float]] = []  # (generation id, its call's reward)
            scored: set[int] = set()
            for obs in children:  # containers come first, each after its own parent
                context = contexts.get(obs.parent, contexts[None])
                span = tracer.start_span(
                    obs.name, context=context, start_time=obs.start_ns, attributes={OURS: True}
                )
                wrapped = self._wrap(classes.get(obs.kind, LangfuseSpan), span, obs)
                if obs.kind == "generation" and obs.call is not None and obs.call.reward is not None:
                    if id(obs.call) not in scored:  # a call shown in two histories: scored on its first
                        scored.add(id(obs.call))
                        call_scores.append((format(span.get_span_context().span_id, "016x"), obs.call.reward))
                if obs.key is not None:
                    contexts[obs.key] = otel.set_span_in_context(span)
                    opened.append((wrapped, obs))
                else:
                    wrapped.end(end_time=obs.end_ns)
            for wrapped, obs in reversed(opened):
                wrapped.end(end_time=obs.end_ns)
            root.end(end_time=plan.root.end_ns)
        for name, value, data_type in plan.scores:
            self._client.create_score(name=name, value=value, trace_id=plan.trace_id, data_type=data_type)
        for observation_id, value in call_scores:  # a call's own reward: a score on its generation
            self._client.create_score(
                name="reward",
                value=value,
                trace_id=plan.trace_id,
                observation_id=observation_id,
                data_type="NUMERIC",
            )

    def _wrap(self, cls: Any, span: Any, obs: Obs) -> Any:
        kwargs: dict[str, Any] = {
            "otel_span": span,
            "langfuse_client": self._client,
            "input": obs.input,
            "output": obs.output,
            "metadata": obs.metadata or None,
            "level": obs.level,
            "status_message": obs.status_message,
        }
        if obs.kind == "generation":
            kwargs.update(model=obs.model, model_parameters=obs.model_parameters, usage_details=obs.usage)
        return cls(**kwargs)

    def _dedupe(self, plan: TracePlan) -> list[Obs]:
        if self.skip_generations is False:
            return plan.children
        kept: list[Obs] = []
        linked: list[str] = []
        records: list[dict[str, Any]] = []  # the skipped generations' training records move to the root
        for obs in plan.children:
            if obs.kind != "generation" or obs.call is None:
                kept.append(obs)
                continue
            if self.skip_generations is True:
                self.skipped_generations += 1
            elif self._handler_generations and (ids := self._handler_generations.match(obs.call)):
                self.skipped_generations += 1
                linked.append(ids)
            else:
                kept.append(obs)
                continue
            if CALL_KEY in obs.metadata:
                records.append({"record": obs.metadata[CALL_KEY], "messages": obs.input})
        if records:
            plan.root.metadata[SKIPPED_CALLS_KEY] = records
        if linked:
            plan.root.metadata["langfuse_generations"] = linked
        if self.skip_generations is True:
            plan.root.metadata["generations_skipped"] = True
        return kept

    # -- helpers --------------------------------------------------------------------------------------------
    def _sdk_call(self, fn: Any, timeout: float, what: str, fresh: bool = False) -> bool:
        """Run a possibly blocking SDK call on a daemon thread; wait at most `timeout`."""
        if fresh or self._sdk_thread is None or not self._sdk_thread.is_alive():
            self._sdk_thread = threading.Thread(
                target=quietly, args=(fn,), name=f"art-langfuse-{what}", daemon=True
            )
            self._sdk_thread.start()
        self._sdk_thread.join(timeout)
        if self._sdk_thread.is_alive():
            if not self._unreachable.said:  # a Langfuse known not to answer was already said, once
                self._warn(
                    f"Langfuse {what} did not finish within {timeout:.1f}s (server slow or down); continuing"
                )
            return False
        return True

    def _warn(self, message: str) -> None:
        now = time.monotonic()
        if now - self._last_warning >= 10.0:
            self._last_warning = now
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        else:
            log.debug(message)


__all__ = ["ImportStats", "LangfuseExporter", "TraceImport", "import_trajectories"]
