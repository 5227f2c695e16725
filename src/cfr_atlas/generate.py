"""Prefill and the one generation driver shared by the API, the CLI and the server.

`prefill` runs a prompt through the model in chunks (the chunk size never changes a result:
every kernel is batch-invariant); it serves `Model.logits`. `Generation` is a sequence's whole
generation as resumable steps — one forward pass of one prompt chunk or one token per step,
sampling when it yields logits — with the stop-text rule (`StopText`) applied in it. A step is
`plan()` (what to feed), the pass, `absorb()` (the result): `step()` runs it as a batch of one
(`Model.stream`, the CLI), the server's scheduler runs many sequences' plans as one batched
pass; the text and telemetry come from the same code either way. Sampling is `Sampler`'s; the
Session (K/V state) is the caller's to open and close.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import CapacityError, ConfigError
from cfr_atlas.models.batch import BatchItem
from cfr_atlas.sampling import Sampler, SamplingParams
from cfr_atlas.text import StopText, Tokenizer

DEFAULT_CHUNK = 256


def check_ids(ids, vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ConfigError("ids", f"token ids must be a non-empty 1-D list of integers, got "
                                 f"shape {arr.shape} dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ConfigError("ids", f"token ids must be in [0, {vocab_size}), got "
                                 f"[{arr.min()}, {arr.max()}]")
    return arr.astype(np.int64)


def _check_count(field: str, value, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        kind = "positive" if lo > 0 else "non-negative"
        raise ConfigError(field, f"must be a {kind} integer, got {value!r}")
    return value


def _check_fits(session, n_new: int) -> None:
    limit = session.context_limit
    if session.n_tokens + n_new > limit:
        raise CapacityError(f"{session.n_tokens + n_new} tokens exceed the context limit "
                            f"{limit} (the model's context length unless set)")


def prefill(model, session, ids: np.ndarray, *, chunk_tokens: int = DEFAULT_CHUNK,
            all_logits: bool = False, progress=None) -> np.ndarray:
    """Run ids through the model in chunks; logits (T, vocab) if all_logits else (1, vocab)."""
    _check_count("chunk_tokens", chunk_tokens, 1)
    _check_fits(session, len(ids))
    out = []
    start = 0 if all_logits else session.map_prefix(ids)  # reused blocks are not recomputed
    for a in range(start, len(ids), chunk_tokens):
        chunk = ids[a:a + chunk_tokens]
        last = a + chunk_tokens >= len(ids)
        logits = model.forward_chunk(session, chunk, all_logits=all_logits,
                                     output=all_logits or last)
        if logits is not None:
            out.append(logits)
        if progress is not None:
            progress(len(chunk))
    return np.concatenate(out) if all_logits else out[-1]


@dataclass(frozen=True)
class Event:
    """What one step did: a prompt chunk (token None) and/or one sampled token (the step of
    the last prompt chunk samples the first token)."""

    text: str = ""  # text now safe to show ("" while it may still start a stop string)
    token: int | None = None  # the token sampled in this step; None if none was
    logits: np.ndarray | None = None  # (vocab,) float32 the token was drawn from (unmasked)
    finish_reason: str | None = None  # "stop" (EOS or a stop string), "length", or None
    prompt_logits: np.ndarray | None = None  # (chunk, vocab) float32, with `prompt_logits` on:
    # row j is the logits after prompt token (fed + j), i.e. those that scored token fed + j + 1


class Generation:
    """One sequence's generation, resumable: each step is one forward pass of this sequence.

    A step feeds the model one prompt chunk or one token: `plan()` says what (a `BatchItem`),
    the caller runs it (alone: `step()`; with other sequences: the server's batched step,
    `forward_batch`) and hands the result to `absorb()`, which samples when the step produced
    logits. Prefill: cached prefix blocks are mapped, then the rest of the prompt goes in
    chunks of at most `chunk_tokens` (the caller may ask for smaller ones: the chunking never
    changes a result); the step of the last chunk also samples the first token. Decode: each
    step feeds the previous token back and samples the next from the whole history (prompt
    included, for the repetition penalty); text is cut at stop strings (`StopText`). It ends at
    EOS or a stop string ("stop"), or after `max_tokens` tokens or when the context is full
    ("length"). Forward time goes to the phase of what was fed, sampling time to decode; time
    between steps (other sequences, the consumer) is not counted.

    `constraint` (a `text.grammar.Constraint`, optional) masks the sampler's input each step;
    the logits themselves (the events', the fingerprint) stay the unconstrained ones.
    `prompt_logits=True` returns every prompt position's logits with its chunk's event (for
    scoring a prompt); the prefix cache is then not used, since mapped blocks have no logits.
    """

    def __init__(self, model, session, prompt_ids, params: SamplingParams, *, max_tokens: int,
                 tokenizer: Tokenizer, stops=(), chunk_tokens: int = DEFAULT_CHUNK,
                 constraint=None, prompt_logits: bool = False):
        self.model, self.session = model, session
        self.max_tokens = _check_count("max_tokens", max_tokens, 0)
        self.chunk_tokens = _check_count("chunk_tokens", chunk_tokens, 1)
        self.ids = check_ids(prompt_ids, model.config.vocab_size)
        self._eos = frozenset(tokenizer.eos_ids)
        self._text = StopText(tokenizer, (stops,) if isinstance(stops, str) else tuple(stops))
        self._sampler = Sampler(params)
        self._constraint = constraint
        self._prompt_logits = prompt_logits
        self._history = self.ids.tolist()
        self._fed: int | None = None  # prompt tokens in the session; None before the first plan
        self._planned: BatchItem | None = None  # what the current step feeds
        self._pending: int | None = None  # sampled, not yet fed back
        self._digest = hashlib.sha256()  # of every sample's logits: a bitwise fingerprint
        self.generated = 0  # tokens sampled, an end-of-generation token included
        self.finish_reason: str | None = None
        self.prefill_seconds = self.decode_seconds = 0.0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prompt_fed(self) -> int:
        """Prompt tokens in the session so far (mapped from the prefix cache or computed)."""
        return self._fed or 0

    @property
    def prefilling(self) -> bool:
        """True while prompt tokens remain to be fed."""
        return self._fed is None or self._fed < len(self.ids)

    def plan(self, max_chunk: int | None = None) -> BatchItem:
        """What this step feeds: the next prompt chunk (at most `chunk_tokens`, and at most
        `max_chunk` if given) or the token sampled last. The first call maps cached prefix
        blocks and checks the prompt fits the context (errors raise here, before any pass)."""
        if self.done:
            raise RuntimeError(f"generation already finished ({self.finish_reason})")
        t0 = time.perf_counter()
        if self._fed is None:
            _check_fits(self.session, len(self.ids))
            # reused blocks are not recomputed (nor scored: none with prompt_logits)
            self._fed = 0 if self._prompt_logits else self.session.map_prefix(self.ids)
        if self._fed < len(self.ids):
            n = self.chunk_tokens if max_chunk is None else min(self.chunk_tokens, max_chunk)
            chunk = self.ids[self._fed:self._fed + _check_count("max_chunk", n, 1)]
            last = self._fed + len(chunk) == len(self.ids)
            self._planned = BatchItem(self.session, chunk, output=last or self._prompt_logits,
                                      all_logits=self._prompt_logits)
            self.prefill_seconds += time.perf_counter() - t0
        else:
            self._planned = BatchItem(self.session, np.array([self._pending], dtype=np.int64))
        return self._planned

    def absorb(self, result, seconds: float = 0.0) -> Event:
        """The planned step's result (logits (1, vocab), None, or the exception the pass gave
        this item: raised here) -> this step's event. `seconds`: the pass's wall time."""
        item, self._planned = self._planned, None
        if item is None:
            raise RuntimeError("absorb() without a plan()")
        if isinstance(result, BaseException):
            raise result
        if self.prefilling:  # a prompt chunk
            self.prefill_seconds += seconds
            self._fed += len(item.ids)
            scored = result if self._prompt_logits else None
            if self._fed < len(self.ids):
                return Event(prompt_logits=scored)
            if self.max_tokens == 0:
                return self._finish("length", self._text.flush(), prompt_logits=scored)
        else:
            self.decode_seconds += seconds
        t0 = time.perf_counter()
        event = self._sample(result[-1])
        self.decode_seconds += time.perf_counter() - t0
        if item.all_logits:  # the last prompt chunk, scored
            event = dataclasses.replace(event, prompt_logits=result)
        return event

    def step(self) -> Event:
        """One step alone: a batch of one through the same `plan` / pass / `absorb`."""
        item = self.plan()
        t0 = time.perf_counter()
        (result,) = self.model.forward_batch([item])
        return self.absorb(result, time.perf_counter() - t0)

    def events(self) -> Iterator[Event]:
        """Every step's event until the generation has finished."""
        while not self.done:
            yield self.step()

    def _sample(self, logits: np.ndarray) -> Event:
        allowed = None if self._constraint is None else self._constraint.allowed()
        token = self._sampler.sample(logits, self._history, allowed)
        if self._constraint is not None and token not in self._eos:
            self._constraint.advance(token)
        self._history.append(token)
        self._digest.update(logits.tobytes())
        self.generated += 1
        self._pending = token
        if token in self._eos:
            return self._finish("stop", self._text.end(), token, logits)
        text, hit_stop = self._text.push(token)
        if hit_stop:
            return self._finish("stop", text, token, logits)
        full = self.session.n_tokens + 1 > self.session.context_limit  # no room to feed it back
        if self.generated == self.max_tokens or full:
            return self._finish("length", text + self._text.flush(), token, logits)
        return Event(text, token, logits)

    def _finish(self, reason: str, text: str, token=None, logits=None,
                prompt_logits=None) -> Event:
        self.finish_reason = reason
        return Event(text, token, logits, reason, prompt_logits)

    def telemetry(self) -> dict:
        """The session's K/V summary plus this generation's token counts and phase seconds."""
        return {**self.session.telemetry_summary(),
                "prompt_tokens": len(self.ids), "generated_tokens": self.generated,
                "prefill_seconds": self.prefill_seconds, "decode_seconds": self.decode_seconds,
                "seconds": self.prefill_seconds + self.decode_seconds,
                "logits_sha256": self._digest.hexdigest()}
