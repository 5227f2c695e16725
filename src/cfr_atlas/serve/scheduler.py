"""The scheduler: one worker thread owns the model and steps all active jobs as one batch.

All model work (prefill chunks, decode steps, embeddings) runs on this thread, so the event
loop only parses requests and moves bytes, and the engine never sees two threads.

A step (continuous batching): every active job plans what it feeds — one decode token, or a
prompt / embedding chunk — and all the plans go through ONE `forward_batch` (the weights are
read once per step); then each job absorbs its own result, in admission order. Decoding jobs
always take part; prompt chunks share `prefill_tokens` tokens per step, in admission order
(the first prefilling job always gets at least one), so a long prompt delays the others'
next token by one bounded chunk, never by its whole prefill. New jobs join at the next step,
finished, cancelled and failed ones leave before it. Every item's result is bitwise what it
would be alone (`forward_batch`'s contract), so batching never changes a response.

Invariants:
  * at most `max_active` jobs are active; at most `max_queue` more wait, first come first
    served; `submit` beyond that raises `QueueFullError` (the server's 429);
  * every active job gets at most one step per round (exactly one unless it is prefilling
    and the round's `prefill_tokens` are spent), absorbed in admission order;
  * a job leaves through `_retire` exactly once, which counts it and calls `release()`
    (session closed, page file removed, resident K/V dropped) on the worker thread;
  * a failing job gets an ("error", exc) event; the others keep running. Errors are per job:
    one raised by its `plan` (checked before the pass) or given as its result by the pass
    (an item that fails inside it leaves the pass without touching the others' sessions).
    Only an exception from the shared kernels themselves fails every job of that pass.
Counters and histograms live in `SchedulerStats`, written under the lock and read as a copy
(`stats()`). This module knows nothing of HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from cfr_atlas.errors import AtlasError, CapacityError, ConfigError, QueueFullError
from cfr_atlas.generate import DEFAULT_CHUNK
from cfr_atlas.serve.histogram import Histogram
from cfr_atlas.serve.jobs import Job

log = logging.getLogger("cfr_atlas.serve")


BATCH_BOUNDS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)  # sequences in one forward pass
TOKEN_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)  # tokens in one forward pass
QUEUE_BOUNDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # s


@dataclass
class SchedulerStats:
    """Cumulative counters and current gauges; bytes are K + V in the storage dtype."""

    submitted: int = 0
    rejected: int = 0  # queue full
    completed: int = 0
    cancelled: int = 0  # client went away
    failed: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    hot_hits: int = 0
    regenerations: int = 0
    active: int = 0
    queued: int = 0
    resident_kv_bytes: int = 0
    steps: int = 0  # batched forward passes
    batch_sizes: Histogram = field(default_factory=lambda: Histogram(BATCH_BOUNDS))
    batch_tokens: Histogram = field(default_factory=lambda: Histogram(TOKEN_BOUNDS))
    queue_seconds: Histogram = field(default_factory=lambda: Histogram(QUEUE_BOUNDS))

    def copy(self) -> SchedulerStats:
        return dataclasses.replace(self, batch_sizes=self.batch_sizes.copy(),
                                   batch_tokens=self.batch_tokens.copy(),
                                   queue_seconds=self.queue_seconds.copy())


class Scheduler:
    """Bounded FIFO admission + batched stepping on one worker thread (see module doc)."""

    def __init__(self, *, max_active: int = 8, max_queue: int = 16, retry_after: int = 1,
                 prefill_tokens: int = DEFAULT_CHUNK):
        for name, value in (("max_active", max_active), ("prefill_tokens", prefill_tokens)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        self.max_active, self.max_queue, self.retry_after = max_active, max_queue, retry_after
        self.prefill_tokens = prefill_tokens
        self._held = False
        self._pending: deque[Job] = deque()
        self._active: list[Job] = []
        self._cv = threading.Condition()
        self._stats = SchedulerStats()
        self._retired_kv = (0, 0)  # hot hits, regenerations of retired jobs
        self._stopping = False
        self._thread: threading.Thread | None = None

    # --- event-loop side -----------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cfr-atlas-scheduler",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cv:
            if self._stopping:
                raise CapacityError("the server is shutting down")
            if len(self._pending) >= self.max_queue:
                self._stats.rejected += 1
                raise QueueFullError(
                    f"the request queue is full ({len(self._active)} active, "
                    f"{len(self._pending)} waiting, limit {self.max_queue}); retry in "
                    f"{self.retry_after} s", self.retry_after)
            self._pending.append(job)
            self._stats.submitted += 1
            self._stats.queued = len(self._pending)
            self._cv.notify()

    def cancel(self, job: Job) -> None:
        """Client gone: drop a waiting job now, or flag an active one for release."""
        with self._cv:
            job.channel.cancelled.set()
            if job in self._pending:
                self._pending.remove(job)
                self._stats.cancelled += 1
                self._stats.queued = len(self._pending)

    def stats(self) -> SchedulerStats:
        with self._cv:
            return self._stats.copy()

    def hold(self, held: bool) -> None:
        """While held, the worker admits and steps nothing (submitted jobs wait); released,
        everything waiting joins the next step. For tests and benchmarks that need several
        requests to start in the same batch."""
        with self._cv:
            self._held = held
            self._cv.notify()

    # --- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and (self._held or not (self._pending or self._active)):
                    self._cv.wait()
                if self._stopping:
                    break
                now = time.perf_counter()
                while self._pending and len(self._active) < self.max_active:
                    job = self._pending.popleft()
                    self._stats.queue_seconds.observe(now - job.submitted)
                    self._active.append(job)
                self._stats.queued, self._stats.active = len(self._pending), len(self._active)
                active = list(self._active)
            self._step(active)
            self._publish()
        self._drain()

    def _step(self, active: list[Job]) -> None:
        """One batched step of the active jobs (see the module docstring)."""
        for job in [j for j in active if j.cancelled]:
            self._retire(job, "cancelled")
        active = [j for j in active if not j.cancelled]
        plans = self._plans(active)
        results = self._forward([(job, item) for job, item in plans.items() if item is not None])
        for job in active:
            if job in plans:
                self._absorb(job, *results.get(job, (None, 0.0)))

    def _plans(self, active: list[Job]) -> dict:
        """job -> its item (or None) for this step: decoding jobs first, then prompt chunks
        while `prefill_tokens` last. A job whose plan raises fails here, before the pass."""
        plans, room = {}, self.prefill_tokens
        for job in [j for j in active if not j.prefilling] + [j for j in active if j.prefilling]:
            prefilling = job.prefilling
            if prefilling and room == 0:
                continue  # waits for the next step
            try:
                item = job.plan(room if prefilling else None)
            except Exception as exc:
                self._fail(job, exc)
                continue
            if prefilling and item is not None:
                room -= min(room, len(item.ids))
            plans[job] = item
        return plans

    def _forward(self, planned: list) -> dict:
        """One `forward_batch` per model (one in a server) -> job -> (result, seconds)."""
        by_net: dict[int, list] = {}
        for job, item in planned:
            by_net.setdefault(id(item.session.model), []).append((job, item))
        out = {}
        for group in by_net.values():
            items = [item for _, item in group]
            t0 = time.perf_counter()
            try:
                results = items[0].session.model.forward_batch(items)
            except Exception as exc:  # a shared kernel failed: every item of the pass fails
                results = [exc] * len(items)
            seconds = time.perf_counter() - t0
            with self._cv:
                self._stats.steps += 1
                self._stats.batch_sizes.observe(len(items))
                self._stats.batch_tokens.observe(sum(len(i.ids) for i in items))
            out.update({job: (r, seconds) for (job, _), r in zip(group, results, strict=True)})
        return out

    def _absorb(self, job: Job, result, seconds: float) -> None:
        try:
            done = job.absorb(result, seconds)
        except Exception as exc:  # AtlasError -> 4xx upstream; anything else is a bug
            return self._fail(job, exc)
        if done:
            self._retire(job, "completed")

    def _fail(self, job: Job, exc: Exception) -> None:
        if not isinstance(exc, AtlasError):
            log.error("job failed", exc_info=exc)
        job.channel.put("error", exc)
        self._retire(job, "failed")

    def _retire(self, job: Job, how: str) -> None:
        _, hits, regens = job.kv_stats()
        prompt, generated = job.token_counts()
        try:
            job.release()
        except Exception:
            log.exception("releasing a job failed")
        with self._cv:
            self._active.remove(job)
            s = self._stats
            setattr(s, how, getattr(s, how) + 1)
            s.prompt_tokens += prompt
            s.generated_tokens += generated
            self._retired_kv = (self._retired_kv[0] + hits, self._retired_kv[1] + regens)
        self._publish()

    def _publish(self) -> None:
        """Refresh the gauges from the active jobs (worker thread: no race on sessions); the
        active count and the K/V bytes change together, under one lock."""
        with self._cv:
            active = list(self._active)
        kv = [job.kv_stats() for job in active]
        with self._cv:
            s = self._stats
            s.active = len(active)
            s.resident_kv_bytes = sum(k[0] for k in kv)
            s.hot_hits = self._retired_kv[0] + sum(k[1] for k in kv)
            s.regenerations = self._retired_kv[1] + sum(k[2] for k in kv)

    def _drain(self) -> None:
        with self._cv:
            jobs = list(self._active) + list(self._pending)
            self._pending.clear()
        for job in jobs:
            job.channel.put("error", CapacityError("the server is shutting down"))
            if job in self._active:
                self._retire(job, "failed")
        self._publish()
