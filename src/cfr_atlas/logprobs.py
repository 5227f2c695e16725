"""Log-probabilities of tokens, from the exact logits the sampler received.

Holds `log_softmax` (float64, max-shifted) and `score` (one token's log-probability and the
`top_n` most likely alternatives). The logits are the raw model output of that step — before
the repetition penalty, temperature, filters or a grammar's mask — so a log-probability is the
model's own, whatever the sampling settings: what prompt scoring and evaluation harnesses
expect. It does not sample, format responses or know token texts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAX_TOP = 20  # alternatives per token (OpenAI's limit for chat)


@dataclass(frozen=True)
class Scored:
    """One token with its log-probability and the `top` alternatives, most likely first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """(V,) float32 -> (V,) float64: logits - logsumexp(logits), computed in float64."""
    x = logits.astype(np.float64)
    x -= x.max()
    return x - np.log(np.exp(x).sum())


def top_ids(logp: np.ndarray, n: int) -> np.ndarray:
    """The n most likely ids, most likely first; ties broken towards the lower id."""
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    n = min(n, logp.size)
    cand = np.argpartition(-logp, n - 1)[:n] if n < logp.size else np.arange(logp.size)
    kth = logp[cand].min()
    cand = np.flatnonzero(logp >= kth)  # every id tied at the boundary, then cut stably
    return cand[np.lexsort((cand, -logp[cand]))][:n]


def score(logits: np.ndarray, token: int, top_n: int = 0) -> Scored:
    """`token`'s log-probability under `logits` (V,) and the `top_n` best alternatives."""
    logp = log_softmax(logits)
    top = tuple((int(i), float(logp[i])) for i in top_ids(logp, top_n))
    return Scored(int(token), float(logp[token]), top)
