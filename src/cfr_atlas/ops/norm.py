"""RMS normalization over the last axis, per token and per head.

Holds `rms_norm` (x: (T, D)) and `rms_norm_per_head` (x: (T, H, hd)), the numba kernel behind
both and its NumPy twin. The arithmetic follows ggml's rms_norm: squares in float32, summed
left to right in float64, mean and scale rounded to float32, then `(x * scale) * weight` in
float32. Each row is one sequential loop over D, so a row's result never depends on how many
rows share the call or which thread runs it (batch invariance; from PARALLEL_ELEMENTS elements
the rows are split between threads). It does not hold LayerNorm (no mean, no bias).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.ops._checks import as_f32, out_buffer

_ONE = np.float32(1.0)


@njit(cache=True, nogil=True, inline="always")
def _rms_norm_row(x, weight, eps, out, t):
    s = 0.0  # float64 accumulator, summed in index order
    dim = x.shape[1]
    for i in range(dim):
        s += np.float64(x[t, i] * x[t, i])
    mean = np.float32(s / dim)
    scale = _ONE / np.sqrt(mean + eps)
    for i in range(dim):
        out[t, i] = (x[t, i] * scale) * weight[i]


@njit(cache=True, nogil=True)
def _rms_norm_kernel(x, weight, eps, out):
    """x: (N, D) f32, weight: (D,) f32, eps: f32 scalar, out: (N, D) f32 (may alias x)."""
    for t in range(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, t)


@njit(cache=True, nogil=True, parallel=True)
def _rms_norm_parallel(x, weight, eps, out):
    """`_rms_norm_kernel` with rows split between threads (each row the same loop)."""
    for t in prange(x.shape[0]):
        _rms_norm_row(x, weight, eps, out, np.int64(t))


# From this many elements a call splits its rows between threads (a row's sum is latency-bound,
# ~1 ns an element: a 2,048-token Gemma 3 prefill spent 4% of its time here on one thread).
PARALLEL_ELEMENTS = 1 << 16


def _norm_rows(x, weight, eps, out) -> None:
    kernel = _rms_norm_parallel if x.size >= PARALLEL_ELEMENTS else _rms_norm_kernel
    kernel(x, weight, eps, out)


def rms_norm_numpy(x, weight, eps, out):
    """NumPy twin of `_rms_norm_kernel`: same arguments, same rounding, same summation order."""
    sums = np.cumsum((x * x).astype(np.float64), axis=1)[:, -1]  # accumulate is sequential
    mean = (sums / x.shape[1]).astype(np.float32)
    scale = _ONE / np.sqrt(mean + eps)
    np.multiply(x * scale[:, None], weight, out=out)


def _eps32(eps: float) -> np.float32:
    if not (math.isfinite(eps) and eps >= 0.0):
        raise ConfigError("eps", f"must be a finite number >= 0, got {eps}")
    return np.float32(eps)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, *, out=None) -> np.ndarray:
    """x: (T, D) float32, weight: (D,) float32 -> (T, D) float32: x / sqrt(mean(x^2) + eps) * w.

    `out` may be `x` itself (in place) when `x` is C-contiguous.
    """
    x = as_f32("x", x, 2)
    weight = as_f32("weight", weight, 1)
    if weight.shape[0] != x.shape[1]:
        raise DimensionError(f"weight has {weight.shape[0]} elements, x rows have {x.shape[1]}")
    out = out_buffer(out, x.shape)
    _norm_rows(x, weight, _eps32(eps), out)
    return out


def rms_norm_per_head(x: np.ndarray, weight: np.ndarray, eps: float, *, out=None) -> np.ndarray:
    """x: (T, H, hd) float32, weight: (hd,) float32 -> (T, H, hd) float32, each head on its own.

    Used for QK-norm; the same weight is shared by every head.
    """
    x = as_f32("x", x, 3)
    weight = as_f32("weight", weight, 1)
    n_tokens, n_heads, head_dim = x.shape
    if weight.shape[0] != head_dim:
        raise DimensionError(f"weight has {weight.shape[0]} elements, head_dim is {head_dim}")
    out = out_buffer(out, x.shape)
    rows = (n_tokens * n_heads, head_dim)
    _norm_rows(x.reshape(rows), weight, _eps32(eps), out.reshape(rows))
    return out
