"""Token sampling: one logits vector in, one token id out.

Holds `SamplingParams` (frozen, validated), `Sampler`, and the pure steps it applies in order:
  repetition penalty (llama.cpp: a recent token's logit is divided by the penalty if > 0,
  multiplied if <= 0, once per distinct token) -> temperature -> top-k -> top-p -> min-p ->
  one draw from `np.random.Generator(PCG64(seed))`.
temperature == 0 is greedy: argmax after the penalty, lowest id on ties, filters ignored.
Probabilities are float64 over the surviving candidates kept in ascending id order, and ties
are broken towards the lower id, so a seed fixes the output. (llama.cpp's default chain applies
temperature after the filters; here it comes first, as in HF transformers.) It does not hold
the engine loop, stop strings, grammars (only their mask, `allowed`) or logit bias.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np

from cfr_atlas.errors import ConfigError, DimensionError, NumericError


def _check_range(field: str, value, lo: float, hi: float = math.inf, lo_open: bool = False):
    if isinstance(value, bool) or not isinstance(value, Real) or not math.isfinite(value):
        raise ConfigError(field, f"must be a finite number, got {value!r}")
    if value < lo or (lo_open and value == lo) or value > hi:
        interval = f"{'(' if lo_open else '['}{lo}, {hi}{']' if hi < math.inf else ')'}"
        raise ConfigError(field, f"must be in {interval}, got {value}")


def _check_int(field: str, value, lo: int):
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise ConfigError(field, f"must be an integer, got {value!r}")
    _check_range(field, value, lo)


@dataclass(frozen=True)
class SamplingParams:
    """Sampling knobs; the defaults give greedy decoding with every filter off."""

    temperature: float = 0.0  # 0 -> greedy argmax
    top_k: int = 0  # 0 -> off
    top_p: float = 1.0  # 1 -> off; keep the smallest prefix whose probability reaches top_p
    min_p: float = 0.0  # 0 -> off; keep tokens with p >= min_p * p_max
    repeat_penalty: float = 1.0  # 1 -> off
    repeat_last_n: int = 64  # how many recent tokens are penalized; 0 off, -1 whole history
    seed: int | None = None  # None -> fresh OS entropy

    def __post_init__(self):
        _check_range("temperature", self.temperature, 0.0)
        _check_int("top_k", self.top_k, 0)
        _check_range("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("repeat_penalty", self.repeat_penalty, 0.0, lo_open=True)
        _check_int("repeat_last_n", self.repeat_last_n, -1)
        if self.seed is not None:
            _check_int("seed", self.seed, 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_logits(logits) -> np.ndarray:
    """Refuse anything but a finite 1-D float32 array (raises DimensionError / NumericError)."""
    if not isinstance(logits, np.ndarray) or logits.ndim != 1 or logits.dtype != np.float32:
        got = (getattr(logits, "dtype", type(logits).__name__), getattr(logits, "shape", None))
        raise DimensionError(f"logits must be a 1-D float32 array, got {got}")
    if logits.size == 0:
        raise DimensionError("logits are empty")
    bad = np.flatnonzero(~np.isfinite(logits))
    if bad.size:
        raise NumericError(
            f"logits hold {bad.size} non-finite values (first at index {bad[0]}: {logits[bad[0]]})"
        )
    return logits


def apply_repeat_penalty(logits: np.ndarray, history: Sequence[int], params: SamplingParams):
    """logits: (V,) float32 -> (V,) float32, recent tokens penalized (a copy; as-is if off)."""
    n = params.repeat_last_n
    if params.repeat_penalty == 1.0 or n == 0 or len(history) == 0:
        return logits
    recent = np.unique(np.asarray(history[-n:] if n > 0 else history, dtype=np.int64))
    if recent[0] < 0 or recent[-1] >= logits.size:
        bad = recent[0] if recent[0] < 0 else recent[-1]
        raise DimensionError(f"history token {bad} is outside the vocabulary of {logits.size}")
    out = logits.copy()
    penalty = np.float32(params.repeat_penalty)
    values = out[recent]
    out[recent] = np.where(values <= 0, values * penalty, values / penalty)
    return out


def _top_k(values: np.ndarray, k: int) -> np.ndarray:
    """Indices (ascending) of the k largest values; among equal values the lower indices win."""
    if k == 0 or k >= values.size:
        return np.arange(values.size)
    kth = np.partition(values, values.size - k)[values.size - k]
    ids = np.flatnonzero(values >= kth)
    if ids.size > k:  # ties at the boundary
        ids = np.sort(ids[np.argsort(-values[ids], kind="stable")][:k])
    return ids


def _top_p(probs: np.ndarray, top_p: float) -> np.ndarray:
    """Mask keeping the most probable entries until their sum first reaches top_p (>= 1 kept).

    Sorting all V entries costs ~6 ms at V = 49152, so only the k most probable are sorted,
    k growing 4x until their sum reaches top_p; the sorted prefix and its running sum are the
    same as a full stable sort's, so the result is too.
    """
    if top_p >= 1.0:
        return np.ones(probs.size, dtype=bool)
    k = min(64, probs.size)
    while True:
        order = _top_k(probs, k)
        order = order[np.argsort(-probs[order], kind="stable")]  # descending, lower id first
        cum = np.cumsum(probs[order])
        if cum[-1] >= top_p or k == probs.size:
            break
        k = min(4 * k, probs.size)
    keep = np.zeros(probs.size, dtype=bool)
    keep[order[: min(int(np.searchsorted(cum, top_p)) + 1, k)]] = True
    return keep


def candidate_probs(logits: np.ndarray, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """Penalized logits (V,) float32 -> (ids ascending, probs float64 summing to 1) to draw from.

    Temperature, then top-k, top-p and min-p, each renormalizing what is left. With
    temperature 0 the distribution is the argmax alone.
    """
    if params.greedy:
        return np.array([np.argmax(logits)]), np.ones(1, dtype=np.float64)
    scaled = (logits.astype(np.float64) - float(logits.max())) / params.temperature
    ids = _top_k(scaled, params.top_k)
    probs = np.exp(scaled[ids])
    probs /= probs.sum()
    keep = _top_p(probs, params.top_p) & (probs >= params.min_p * probs.max())
    ids, probs = ids[keep], probs[keep]
    return ids, probs / probs.sum()


def mask_logits(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """(V,) float32 logits, (V,) bool -> a copy with disallowed entries at -inf."""
    if allowed.shape != logits.shape or allowed.dtype != np.bool_:
        raise DimensionError(f"allowed must be a {logits.shape} bool mask, got "
                             f"{allowed.shape} {allowed.dtype}")
    if not allowed.any():
        raise NumericError("the grammar allows no token at this step")
    return np.where(allowed, logits, np.float32(-np.inf))


class Sampler:
    """Draws token ids with one `SamplingParams` and its own PCG64 stream.

    The same seed and the same (logits, history) calls give the same ids.
    """

    def __init__(self, params: SamplingParams | None = None):
        self.params = SamplingParams() if params is None else params
        self._rng = np.random.Generator(np.random.PCG64(self.params.seed))

    def sample(self, logits: np.ndarray, history: Sequence[int] = (),
               allowed: np.ndarray | None = None) -> int:
        """logits: (V,) float32, history: ids generated or prompted so far -> one token id.

        allowed: (V,) bool, the tokens a grammar permits (None: all). Applied after the
        penalty, to a copy: `logits` itself is never changed. Without it, or when it allows
        every token, the draw is exactly the unconstrained one.
        """
        penalized = apply_repeat_penalty(check_logits(logits), history, self.params)
        if allowed is not None:
            penalized = mask_logits(penalized, allowed)
        if self.params.greedy:
            return int(np.argmax(penalized))  # first maximum = lowest id
        ids, probs = candidate_probs(penalized, self.params)
        if allowed is not None:  # masked ids have probability 0: drop them before the draw
            ids, probs = ids[probs > 0], probs[probs > 0]
        cdf = np.cumsum(probs)
        i = int(np.searchsorted(cdf, self._rng.random() * cdf[-1], side="right"))
        return int(ids[min(i, ids.size - 1)])
