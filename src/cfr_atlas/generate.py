"""Prefill, decode step and the generation iterator shared by the API, the CLI and the server.

`prefill` runs a prompt through the model in chunks (the chunk size never changes a result:
every kernel is batch-invariant); `generate_steps` then yields one `Step` per new token.
Tokenization and sampling stay outside: steps carry ids and logits, callers turn them into text.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import CapacityError, ConfigError
from cfr_atlas.sampling import Sampler, SamplingParams

DEFAULT_CHUNK = 256


@dataclass
class Step:
    """One generated token: its id, the logits it was drawn from, and the stop reason if any."""

    token: int
    logits: np.ndarray
    finish_reason: str | None = None  # "stop" (EOS), "length" (max tokens) or None


def check_ids(ids, vocab_size: int) -> np.ndarray:
    arr = np.asarray(ids)
    if arr.ndim != 1 or arr.size == 0 or arr.dtype.kind not in "iu":
        raise ConfigError("ids", f"token ids must be a non-empty 1-D list of integers, got "
                                 f"shape {arr.shape} dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() >= vocab_size:
        raise ConfigError("ids", f"token ids must be in [0, {vocab_size}), got "
                                 f"[{arr.min()}, {arr.max()}]")
    return arr.astype(np.int64)


def prefill(model, session, ids: np.ndarray, *, chunk_tokens: int = DEFAULT_CHUNK,
            all_logits: bool = False, progress=None) -> np.ndarray:
    """Run ids through the model in chunks; logits (T, vocab) if all_logits else (1, vocab)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError("chunk_tokens", f"must be a positive integer, got {chunk_tokens!r}")
    limit = session.context_limit
    if session.n_tokens + len(ids) > limit:
        raise CapacityError(f"{session.n_tokens + len(ids)} tokens exceed the context limit "
                            f"{limit} (the model's context length unless set)")
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


def generate_steps(model, session, prompt_ids, params: SamplingParams, *, max_tokens: int,
                   eos_ids=(), chunk_tokens: int = DEFAULT_CHUNK) -> Iterator[Step]:
    """Prefill the prompt, then sample and feed back one token at a time."""
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
        raise ConfigError("max_tokens", f"must be a non-negative integer, got {max_tokens!r}")
    ids = check_ids(prompt_ids, model.config.vocab_size)
    sampler = Sampler(params)
    history = ids.tolist()
    logits = prefill(model, session, ids, chunk_tokens=chunk_tokens)[0]
    for i in range(max_tokens):
        token = sampler.sample(logits, history)
        history.append(token)
        if token in eos_ids:
            yield Step(token, logits, "stop")
            return
        if i + 1 == max_tokens or session.n_tokens + 1 > session.context_limit:
            yield Step(token, logits, "length")
            return
        yield Step(token, logits)
        logits = model.forward_chunk(session, np.array([token], dtype=np.int64),
                                     all_logits=False)[0]


class Timer:
    """Wall-clock seconds of named phases (prompt, generation) for telemetry lines."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.marks: dict[str, float] = {}

    def mark(self, name: str) -> float:
        now = time.perf_counter()
        self.marks[name] = now - self.t0
        self.t0 = now
        return self.marks[name]
