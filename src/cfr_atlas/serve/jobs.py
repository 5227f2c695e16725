"""Units of model work the scheduler steps: a generation and an embedding batch.

A job is stepped by the scheduler's worker thread until `step()` returns True, then released
once. A `GenerationJob` prefills its prompt one chunk per step (so other streams keep moving
during a long prefill), then decodes one token per step through `generate_steps`. An
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
from cfr_atlas.generate import DEFAULT_CHUNK, generate_steps, prefill
from cfr_atlas.sampling import SamplingParams
from cfr_atlas.serve.stops import StopText


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
    """How a generation ended. Seconds are the worker's time on this sequence's steps."""

    prompt_tokens: int
    eval_count: int  # sampled tokens, the end-of-generation token included
    done_reason: str  # "stop" (EOS or a stop string) or "length"
    queue_seconds: float  # submitted -> first step
    prompt_seconds: float  # prefill and the first sample
    eval_seconds: float  # every later decode step
    telemetry: dict  # Session.telemetry_summary()


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


def prefeed_end(n_prompt: int, params: SamplingParams) -> int:
    """How many leading prompt tokens may be prefilled in separate chunk steps.

    `generate_steps` builds the repetition-penalty history from the ids it is given, so the
    tail it gets must cover the penalty window; whole-history windows get the whole prompt.
    Chunks are DEFAULT_CHUNK-aligned, so the prefill is split exactly as `prefill` splits it.
    """
    if params.repeat_penalty != 1.0 and params.repeat_last_n < 0:
        return 0
    tail = max(params.repeat_last_n, 1) if params.repeat_penalty != 1.0 else 1
    return max(0, (n_prompt - tail) // DEFAULT_CHUNK * DEFAULT_CHUNK)


class GenerationJob(Job):
    """One sequence: its own Session, prefill chunks, then one decode step per turn."""

    def __init__(self, model, spec: GenerationSpec, channel: Channel):
        super().__init__(channel)
        self.model, self.spec = model, spec
        self._ids = np.asarray(spec.ids, dtype=np.int64)
        self._prefeed = prefeed_end(len(spec.ids), spec.params)
        self._fed = 0
        self._session = None
        self._steps = None
        self._text = StopText(model.tokenizer, spec.stops)
        self._n = 0
        self._started: float | None = None
        self._prompt_s = self._eval_s = 0.0

    def step(self) -> bool:
        t0 = time.perf_counter()
        in_prompt = self._n == 0
        end = self._advance()
        dt = time.perf_counter() - t0
        if in_prompt:
            self._prompt_s += dt
        else:
            self._eval_s += dt
        if end is None:
            return False
        reason, tail = end
        if tail:
            self.channel.put("text", tail)
        self.channel.put("done", Outcome(
            prompt_tokens=len(self.spec.ids), eval_count=self._n, done_reason=reason,
            queue_seconds=self._started - self.submitted, prompt_seconds=self._prompt_s,
            eval_seconds=self._eval_s, telemetry=self._session.telemetry_summary()))
        return True

    def _advance(self) -> tuple[str, str] | None:
        """One unit of work; (done_reason, last text) when the sequence has ended."""
        if self._session is None:
            self._started = time.perf_counter()
            self._session = self.model.session(**self.spec.session_kw)
            if self._prefeed:  # cached whole blocks of the prompt are mapped, not recomputed
                self._fed = self._session.map_prefix(self._ids[:self._prefeed + 1])
        if self._fed < self._prefeed:
            chunk = self._ids[self._fed:self._fed + DEFAULT_CHUNK]
            prefill(self.model.net, self._session, chunk)
            self._fed += len(chunk)
            return None
        if self._steps is None:
            self._steps = generate_steps(
                self.model.net, self._session, self._ids[self._fed:], self.spec.params,
                max_tokens=self.spec.max_tokens, eos_ids=self.model.tokenizer.eos_ids)
        step = next(self._steps, None)
        if step is None:  # max_tokens == 0
            return "length", self._text.flush()
        self._n += 1
        if step.finish_reason == "stop":
            return "stop", self._text.end()
        piece, hit_stop = self._text.push(step.token)
        if hit_stop:
            return "stop", piece
        if step.finish_reason == "length":
            return "length", piece + self._text.flush()
        if piece:
            self.channel.put("text", piece)
        return None

    def release(self) -> None:
        if self._steps is not None:
            self._steps.close()
        if self._session is not None:
            self._session.close()  # removes the page file
            self._session.atlas.reset()  # drops every resident K/V page

    def kv_stats(self) -> tuple[int, int, int]:
        if self._session is None:
            return 0, 0, 0
        t = self._session.atlas.telemetry()
        return t.resident_bytes, t.total.hot_hits, t.total.regenerations

    def token_counts(self) -> tuple[int, int]:
        prompt = len(self.spec.ids) if self._n else self._fed
        return prompt, self._n


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
