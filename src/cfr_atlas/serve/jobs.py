"""Units of model work the scheduler steps: a generation and an embedding batch.

A job is stepped by the scheduler's worker thread until `step()` returns True, then released
once. A `GenerationJob` steps the same driver as `Model.stream` (`generate.Generation`): one
prefill chunk per step (so other streams keep moving during a long prefill), then one token
per step, with the same stop-text rule and phase timings. An
`EmbeddingJob` also runs one chunk of DEFAULT_CHUNK tokens per step, so a long input delays the
other streams by one chunk at a time, with the result bitwise `Model.embedding`'s. Results go
to the event loop through the job's `Channel` as ("text", str), ("done", outcome) or
("error", exception). This module knows nothing of HTTP, JSON or queues.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from cfr_atlas.engine import mean_pool
from cfr_atlas.generate import DEFAULT_CHUNK, Generation
from cfr_atlas.sampling import SamplingParams


class Channel:
    """One job's events, from the worker thread to an asyncio queue; plus its cancel flag."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._queue: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def put(self, kind: str, value) -> None:
        """Called on the worker thread; a closed loop means nobody listens any more."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (kind, value))
        except RuntimeError:
            pass

    async def get(self) -> tuple[str, object]:
        return await self._queue.get()


@dataclass(frozen=True)
class GenerationSpec:
    """What to generate: validated prompt ids, sampling, token limit, stops, Session kwargs."""

    ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int
    stops: tuple[str, ...] = ()
    session_kw: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Outcome:
    """How a generation ended. Seconds are the worker's time on this sequence's own steps,
    as the driver measured them (`Generation.telemetry()`, which `telemetry` holds)."""

    prompt_tokens: int
    eval_count: int  # sampled tokens, the end-of-generation token included
    done_reason: str  # "stop" (EOS or a stop string) or "length"
    queue_seconds: float  # submitted -> first step
    prompt_seconds: float  # prefill chunks (the driver's prefill_seconds)
    eval_seconds: float  # decode steps, every sample included (decode_seconds)
    telemetry: dict  # Generation.telemetry(): the session's K/V summary, counts, seconds


@dataclass(frozen=True)
class EmbedOutcome:
    vectors: list[np.ndarray]  # one (dim,) float32 per input
    prompt_tokens: int
    seconds: float


class Job:
    """Scheduled work: `step()` until it returns True, then `release()` exactly once."""

    def __init__(self, channel: Channel):
        self.channel = channel
        self.submitted = time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self.channel.cancelled.is_set()

    def step(self) -> bool:
        raise NotImplementedError

    def release(self) -> None:
        """Free whatever the job holds (sessions, page files); safe after a failed step."""

    def kv_stats(self) -> tuple[int, int, int]:
        """(resident K/V bytes, hot-cache hits, pages regenerated) of the job's session."""
        return 0, 0, 0

    def token_counts(self) -> tuple[int, int]:
        """(prompt tokens prefilled, tokens generated) so far."""
        return 0, 0


class GenerationJob(Job):
    """One sequence: its own Session and `Generation`, one prefill chunk or token per turn."""

    def __init__(self, model, spec: GenerationSpec, channel: Channel):
        super().__init__(channel)
        self.model, self.spec = model, spec
        self._session = None
        self._run: Generation | None = None
        self._started: float | None = None

    def step(self) -> bool:
        if self._run is None:
            self._start()
        event = self._run.step()
        if event.text:
            self.channel.put("text", event.text)
        if event.finish_reason is None:
            return False
        t = self._run.telemetry()
        self.channel.put("done", Outcome(
            prompt_tokens=t["prompt_tokens"], eval_count=t["generated_tokens"],
            done_reason=event.finish_reason, queue_seconds=self._started - self.submitted,
            prompt_seconds=t["prefill_seconds"], eval_seconds=t["decode_seconds"], telemetry=t))
        return True

    def _start(self) -> None:
        """First turn, on the worker thread: open the session (kept for `release` even if the
        driver refuses the request) and the driver."""
        self._started = time.perf_counter()
        self._session = self.model.session(**self.spec.session_kw)
        self._run = Generation(self.model.net, self._session, self.spec.ids, self.spec.params,
                               max_tokens=self.spec.max_tokens, tokenizer=self.model.tokenizer,
                               stops=self.spec.stops)

    def release(self) -> None:
        if self._session is not None:
            self._session.close()  # removes the page file
            self._session.atlas.reset()  # drops every resident K/V page

    def kv_stats(self) -> tuple[int, int, int]:
        if self._session is None:
            return 0, 0, 0
        t = self._session.atlas.telemetry()
        return t.resident_bytes, t.total.hot_hits, t.total.regenerations

    def token_counts(self) -> tuple[int, int]:
        if self._run is None:
            return 0, 0
        return self._run.prompt_fed, self._run.generated


class EmbeddingJob(Job):
    """Embeds its inputs in turn, one chunk of DEFAULT_CHUNK tokens per step.

    Each input gets its own Session (`session_kw`: the request's K/V budget, cache salt) and
    is split exactly as `Model.embedding` splits it; the pooled vector is `mean_pool` of the
    same hidden states, so it is bitwise the same.
    """

    def __init__(self, model, inputs: list[list[int]], channel: Channel,
                 session_kw: dict | None = None):
        super().__init__(channel)
        self.model, self.inputs = model, inputs
        self.session_kw = session_kw or {}
        self.vectors: list[np.ndarray] = []
        self._session = None
        self._hidden: list[np.ndarray] = []
        self._seconds = 0.0

    def step(self) -> bool:
        t0 = time.perf_counter()
        self._advance()
        self._seconds += time.perf_counter() - t0
        if len(self.vectors) < len(self.inputs):
            return False
        n = sum(len(ids) for ids in self.inputs)
        self.channel.put("done", EmbedOutcome(self.vectors, n, self._seconds))
        return True

    def _advance(self) -> None:
        """One chunk of the current input; pool and close its session after the last."""
        ids = np.asarray(self.inputs[len(self.vectors)], dtype=np.int64)
        if self._session is None:
            # sized to this input, so budgeted buffers are no larger than it needs
            self._session = self.model.session(**{"context_limit": len(ids), **self.session_kw})
        a = self._session.n_tokens
        self._hidden.append(self.model.net.forward_chunk(
            self._session, ids[a:a + DEFAULT_CHUNK], hidden=True))
        if self._session.n_tokens < len(ids):
            return
        self.vectors.append(mean_pool(np.concatenate(self._hidden)))
        self._hidden = []
        self.release()

    def release(self) -> None:
        if self._session is not None:
            self._session.close()  # removes the page file
            self._session.atlas.reset()  # drops every resident K/V page
            self._session = None

    def kv_stats(self) -> tuple[int, int, int]:
        if self._session is None:
            return 0, 0, 0
        t = self._session.atlas.telemetry()
        return t.resident_bytes, t.total.hot_hits, t.total.regenerations

    def token_counts(self) -> tuple[int, int]:
        return sum(len(ids) for ids in self.inputs[:len(self.vectors)]), 0
