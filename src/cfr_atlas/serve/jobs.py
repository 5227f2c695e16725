"""Units of model work the scheduler steps: a generation and an embedding batch.

A job is stepped by the scheduler's worker thread until a step reports it done, then released
once. A step is `plan()` (the `BatchItem` the job feeds this step, or None), one batched
forward pass over every active job's item, then `absorb()` (this job's result; True when
done); `step()` runs one alone. A `GenerationJob` steps the same driver as `Model.stream`
(`generate.Generation`): prompt chunks (so other streams keep moving during a long prefill),
then one token per step, with the same stop-text rule and phase timings. An `EmbeddingJob`
feeds one chunk of at most DEFAULT_CHUNK tokens per step, so a long input delays the other
streams by one chunk at a time, with the result bitwise `Model.embedding`'s. Results go to the
event loop through the job's `Channel` as ("text", str), ("done", outcome) or
("error", exception), and, when asked, ("logprobs" / "prompt_logprobs", [Scored]) before a
step's text. This module knows nothing of HTTP, JSON or queues.
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from cfr_atlas.engine import mean_pool
from cfr_atlas.generate import DEFAULT_CHUNK, Generation
from cfr_atlas.logprobs import score
from cfr_atlas.models.batch import BatchItem
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
    constraint: object = None  # a text.grammar.Constraint (its own state: one per request)
    logprobs: int | None = None  # None: off; else score each token with this many alternatives
    prompt_logprobs: bool = False  # score the prompt's tokens too (echo + logprobs)


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
    logprobs: tuple = ()  # logprobs.Scored per generated token (end-of-generation excluded)
    prompt_logprobs: tuple = ()  # Scored per prompt token after the first


@dataclass(frozen=True)
class EmbedOutcome:
    vectors: list[np.ndarray]  # one (dim,) float32 per input
    prompt_tokens: int
    seconds: float


class Job:
    """Scheduled work: steps (`plan`, the pass, `absorb`) until one returns True, then
    `release()` exactly once."""

    prefilling = False  # True while the job feeds prompt-like chunks (capped per step)

    def __init__(self, channel: Channel):
        self.channel = channel
        self.submitted = time.perf_counter()

    @property
    def cancelled(self) -> bool:
        return self.channel.cancelled.is_set()

    def plan(self, max_chunk: int | None = None) -> BatchItem | None:
        """What the job feeds the model this step (a chunk of at most `max_chunk` tokens when
        prefilling); None: no model work this step."""
        return None

    def absorb(self, result, seconds: float) -> bool:
        """The planned item's result (None without a plan; an exception from the pass is
        raised); `seconds`: the pass's wall time. True when the job is done."""
        raise NotImplementedError

    def step(self) -> bool:
        """One step alone: the plan as a batch of one."""
        item = self.plan()
        t0 = time.perf_counter()
        result = None if item is None else item.session.model.forward_batch([item])[0]
        return self.absorb(result, time.perf_counter() - t0)

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
        self._scored: list = []
        self._prompt_scored: list = []

    @property
    def prefilling(self) -> bool:
        return self._run is None or self._run.prefilling

    def plan(self, max_chunk: int | None = None) -> BatchItem:
        if self._run is None:
            self._start()
        return self._run.plan(max_chunk)

    def absorb(self, result, seconds: float) -> bool:
        event = self._run.absorb(result, seconds)
        self._score(event)
        if event.text:
            self.channel.put("text", event.text)
        if event.finish_reason is None:
            return False
        t = self._run.telemetry()
        self.channel.put("done", Outcome(
            prompt_tokens=t["prompt_tokens"], eval_count=t["generated_tokens"],
            done_reason=event.finish_reason, queue_seconds=self._started - self.submitted,
            prompt_seconds=t["prefill_seconds"], eval_seconds=t["decode_seconds"], telemetry=t,
            logprobs=tuple(self._scored), prompt_logprobs=tuple(self._prompt_scored)))
        return True

    def _score(self, event) -> None:
        """Log-probabilities of this step's prompt rows and sampled token, if asked for; sent
        as ("prompt_logprobs", [Scored]) / ("logprobs", [Scored]) before the step's text."""
        spec = self.spec
        if spec.prompt_logprobs and event.prompt_logits is not None:
            a = len(self._prompt_scored) + 1  # row j of this chunk scores prompt token a + j
            rows = event.prompt_logits[:len(spec.ids) - a]
            scored = [score(row, spec.ids[a + j], spec.logprobs or 0)
                      for j, row in enumerate(rows)]
            self._prompt_scored += scored
            self.channel.put("prompt_logprobs", scored)
        if spec.logprobs is not None and event.token is not None \
                and event.token not in self.model.tokenizer.eos_ids:
            scored = [score(event.logits, event.token, spec.logprobs)]
            self._scored += scored
            self.channel.put("logprobs", scored)

    def _start(self) -> None:
        """First turn, on the worker thread: open the session (kept for `release` even if the
        driver refuses the request) and the driver."""
        self._started = time.perf_counter()
        self._session = self.model.session(**self.spec.session_kw)
        self._run = Generation(self.model.net, self._session, self.spec.ids, self.spec.params,
                               max_tokens=self.spec.max_tokens, tokenizer=self.model.tokenizer,
                               stops=self.spec.stops, constraint=self.spec.constraint,
                               prompt_logits=self.spec.prompt_logprobs)

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
    """Embeds its inputs in turn, one chunk of at most DEFAULT_CHUNK tokens per step.

    Each input gets its own Session (`session_kw`: the request's K/V budget, cache salt); the
    hidden states are row-independent, so however the scheduler cuts the chunks they are those
    of `Model.embedding`, and the pooled vector (`mean_pool`) is bitwise the same.
    """

    prefilling = True

    def __init__(self, model, inputs: list[list[int]], channel: Channel,
                 session_kw: dict | None = None):
        super().__init__(channel)
        self.model, self.inputs = model, inputs
        self.session_kw = session_kw or {}
        self.vectors: list[np.ndarray] = []
        self._session = None
        self._hidden: list[np.ndarray] = []
        self._seconds = 0.0

    def plan(self, max_chunk: int | None = None) -> BatchItem:
        """The next chunk of the current input (its session opened on its first chunk)."""
        t0 = time.perf_counter()
        ids = np.asarray(self.inputs[len(self.vectors)], dtype=np.int64)
        if self._session is None:
            # sized to this input, so budgeted buffers are no larger than it needs
            self._session = self.model.session(**{"context_limit": len(ids), **self.session_kw})
        a = self._session.n_tokens
        n = DEFAULT_CHUNK if max_chunk is None else min(DEFAULT_CHUNK, max_chunk)
        self._seconds += time.perf_counter() - t0
        return BatchItem(self._session, ids[a:a + n], all_logits=True, hidden=True)

    def absorb(self, result, seconds: float) -> bool:
        """Keep the chunk's hidden states; pool and close the input's session after its last
        chunk; True after the last input."""
        if isinstance(result, BaseException):
            raise result
        self._seconds += seconds
        self._hidden.append(result)
        if self._session.n_tokens < len(self.inputs[len(self.vectors)]):
            return False
        self.vectors.append(mean_pool(np.concatenate(self._hidden)))
        self._hidden = []
        self.release()
        if len(self.vectors) < len(self.inputs):
            return False
        n = sum(len(ids) for ids in self.inputs)
        self.channel.put("done", EmbedOutcome(self.vectors, n, self._seconds))
        return True

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
