"""The scheduler: one worker thread owns the model and steps the active jobs round-robin.

All model work (prefill chunks, decode steps, embeddings) runs on this thread, so the event
loop only parses requests and moves bytes, and the engine never sees two threads.

Invariants:
  * at most `max_active` jobs are active; at most `max_queue` more wait, first come first
    served; `submit` beyond that raises `QueueFullError` (the server's 429);
  * every active job gets exactly one step per round, in admission order;
  * a job leaves through `_retire` exactly once, which counts it and calls `release()`
    (session closed, page file removed, resident K/V dropped) on the worker thread;
  * a failing job (any exception) gets an ("error", exc) event; the others keep running.
Counters live in `SchedulerStats`, written under the lock and read as a copy (`stats()`).
This module knows nothing of HTTP.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import deque
from dataclasses import dataclass

from cfr_atlas.errors import AtlasError, CapacityError, QueueFullError
from cfr_atlas.serve.jobs import Job

log = logging.getLogger("cfr_atlas.serve")


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


class Scheduler:
    """Bounded FIFO admission + round-robin stepping on one worker thread (see module doc)."""

    def __init__(self, *, max_active: int = 4, max_queue: int = 16, retry_after: int = 1):
        self.max_active, self.max_queue, self.retry_after = max_active, max_queue, retry_after
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
            return dataclasses.replace(self._stats)

    # --- worker thread -------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._stopping and not self._pending and not self._active:
                    self._cv.wait()
                if self._stopping:
                    break
                while self._pending and len(self._active) < self.max_active:
                    self._active.append(self._pending.popleft())
                self._stats.queued, self._stats.active = len(self._pending), len(self._active)
                active = list(self._active)
            for job in active:
                self._turn(job)
            self._publish()
        self._drain()

    def _turn(self, job: Job) -> None:
        if job.cancelled:
            return self._retire(job, "cancelled")
        try:
            done = job.step()
        except Exception as exc:  # AtlasError -> 4xx upstream; anything else is a bug
            if not isinstance(exc, AtlasError):
                log.exception("job failed")
            job.channel.put("error", exc)
            return self._retire(job, "failed")
        if done:
            self._retire(job, "completed")

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
