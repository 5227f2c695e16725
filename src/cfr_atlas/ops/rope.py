"""Rotary position embedding (RoPE) in both pair conventions, forward and inverse.

Holds the frequency table (`rope_freqs`), the per-position cos/sin table (`rope_cos_sin`), the
rotation (`rotate`) and the one-call `apply_rope`. Conventions (`RopeMode`):
  NORMAL  pairs (x[2i], x[2i+1])          llama.cpp mode 0, used for `llama` GGUFs
  NEOX    pairs (x[i], x[i + n_rot/2])    llama.cpp mode 2, HF `rotate_half`
Pair i turns by angle pos * freq[i], freq[i] = freq_scale * theta^(-2i/n_rot) / freq_factors[i];
dims at and past n_rot pass through unchanged (partial rotary).

Batch invariance: an angle is computed in float64 as pos * freq[i], a pure function of
(position, frequency), then cos/sin are rounded to float32; never accumulated across positions.
The rotation is elementwise float32, so a token's result does not depend on its neighbours.
(ggml instead builds theta^(-2i/n) by repeated float32 multiplication, so values can differ
from llama.cpp by an ulp.) `yarn_freqs` holds YaRN's ramp between interpolated and extrapolated
frequencies (deepseek2); its attention factor is the model's. No LongRoPE.
"""

from __future__ import annotations

import math
from enum import StrEnum

import numpy as np
from numba import njit

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.ops._checks import as_f32, out_buffer


class RopeMode(StrEnum):
    NORMAL = "normal"
    NEOX = "neox"


def _mode(mode: str) -> RopeMode:
    try:
        return RopeMode(mode)
    except ValueError:
        expected = "expected 'normal' or 'neox'"
        raise ConfigError("mode", f"unknown RoPE mode {mode!r}, {expected}") from None


def rope_freqs(
    n_rot: int, *, theta: float = 10000.0, freq_factors=None, freq_scale: float = 1.0
) -> np.ndarray:
    """-> (n_rot // 2,) float64 radians per position for each rotated pair."""
    if not (isinstance(n_rot, int) and n_rot >= 2 and n_rot % 2 == 0):
        raise ConfigError("n_rot", f"must be an even integer >= 2, got {n_rot}")
    if not (math.isfinite(theta) and theta > 0.0):
        raise ConfigError("theta", f"must be a finite number > 0, got {theta}")
    if not (math.isfinite(freq_scale) and freq_scale > 0.0):
        raise ConfigError("freq_scale", f"must be a finite number > 0, got {freq_scale}")
    i = np.arange(n_rot // 2, dtype=np.float64)
    freqs = freq_scale * np.power(np.float64(theta), -2.0 * i / n_rot)
    if freq_factors is None:
        return freqs
    ff = as_f32("freq_factors", freq_factors, 1)
    if ff.shape[0] != n_rot // 2:
        raise DimensionError(f"freq_factors has {ff.shape[0]} entries, n_rot / 2 is {n_rot // 2}")
    if not np.all(np.isfinite(ff) & (ff > 0)):
        raise ConfigError("freq_factors", "entries must be finite and > 0")
    return freqs / ff.astype(np.float64)


def yarn_freqs(n_rot: int, *, theta: float, freq_scale: float, n_ctx_orig: int,
               beta_fast: float = 32.0, beta_slow: float = 1.0,
               ext_factor: float = 1.0) -> np.ndarray:
    """-> (n_rot // 2,) float64 YaRN frequencies, as ggml's rope_yarn mixes them.

    Pair i's extrapolated frequency is f_i = theta^(-2i / n_rot), its interpolated one
    freq_scale * f_i; a ramp over the pairs keeps the fast pairs (i below the correction
    dimension of beta_fast rotations in n_ctx_orig) extrapolated and the slow ones (past that of
    beta_slow) interpolated, linear between:
        corr(b) = n_rot * ln(n_ctx_orig / (2 pi b)) / (2 ln theta)
        lo = max(0, floor(corr(beta_fast))),  hi = min(n_rot - 1, ceil(corr(beta_slow)))
        mix_i = ext_factor * (1 - clip((i - lo) / max(0.001, hi - lo), 0, 1))
        freq_i = freq_scale f_i (1 - mix_i) + f_i mix_i
    The attention factor (ggml's mscale on cos and sin) is the caller's.
    """
    base = rope_freqs(n_rot, theta=theta)
    if not (isinstance(n_ctx_orig, int) and n_ctx_orig >= 1):
        raise ConfigError("n_ctx_orig", f"must be a positive integer, got {n_ctx_orig!r}")
    if not (math.isfinite(freq_scale) and freq_scale > 0.0):
        raise ConfigError("freq_scale", f"must be a finite number > 0, got {freq_scale}")

    def corr(rotations: float) -> float:
        return n_rot * math.log(n_ctx_orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    lo = max(0.0, math.floor(corr(beta_fast)))
    hi = min(n_rot - 1.0, math.ceil(corr(beta_slow)))
    i = np.arange(n_rot // 2, dtype=np.float64)
    mix = ext_factor * (1.0 - np.clip((i - lo) / max(0.001, hi - lo), 0.0, 1.0))
    return freq_scale * base * (1.0 - mix) + base * mix


def _positions(positions) -> np.ndarray:
    pos = np.asarray(positions)
    if pos.ndim != 1 or pos.dtype.kind not in "iu":
        raise DimensionError(f"positions must be a 1-D integer array, got {pos.dtype} {pos.shape}")
    return pos


def rope_cos_sin(positions, freqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """positions: (T,) int, freqs: (n_rot/2,) float64 -> cos, sin: (T, n_rot/2) float32."""
    angles = _positions(positions).astype(np.float64)[:, None] * freqs[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def _pair_slices(mode: RopeMode, half: int) -> tuple[slice, slice]:
    if mode is RopeMode.NORMAL:
        return slice(0, 2 * half, 2), slice(1, 2 * half, 2)
    return slice(0, half), slice(half, 2 * half)


def rotate(
    x: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    *,
    mode: str = "normal",
    inverse: bool = False,
    out=None,
) -> np.ndarray:
    """x: (T, H, hd) float32, cos/sin: (T, n_rot/2) float32 -> (T, H, hd) float32.

    Each pair (a, b) becomes (a*cos - b*sin, a*sin + b*cos); `inverse` negates sin (exactly),
    undoing the rotation. Dims at and past n_rot are copied. `out` may be `x` (in place).
    """
    x = as_f32("x", x, 3)
    cos = as_f32("cos", cos, 2)
    sin = as_f32("sin", sin, 2)
    n_tokens, _, head_dim = x.shape
    half = cos.shape[1]
    if cos.shape != sin.shape or cos.shape[0] != n_tokens or 2 * half > head_dim:
        raise DimensionError(
            f"cos {cos.shape} / sin {sin.shape} do not fit x {x.shape}: need ({n_tokens}, n)"
            f" with 2n <= head_dim {head_dim}"
        )
    neox = _mode(mode) is RopeMode.NEOX
    out = out_buffer(out, x.shape)
    _rotate_kernel(x, cos, sin, neox, -1.0 if inverse else 1.0, out)
    return out


@njit(cache=True, nogil=True)
def _rotate_kernel(x, cos, sin, neox, sign, out):
    """`rotate`'s arithmetic: per pair (a, b), a*c - b*s and a*s + b*c in float32, each
    product and sum rounded on its own (no fused multiply-add), s = sign * sin (exact); dims
    past the rotated pairs copied. Pairs are read before they are written (out may be x)."""
    n_tok, n_head, head_dim = x.shape
    half = cos.shape[1]
    for t in range(n_tok):
        for h in range(n_head):
            for i in range(half):
                ia, ib = (i, i + half) if neox else (2 * i, 2 * i + 1)
                a, b = x[t, h, ia], x[t, h, ib]
                c, s = cos[t, i], np.float32(sign) * sin[t, i]
                out[t, h, ia] = a * c - b * s
                out[t, h, ib] = a * s + b * c
            for e in range(2 * half, head_dim):
                out[t, h, e] = x[t, h, e]


def rotate_numpy(x, cos, sin, *, mode: str = "normal", inverse: bool = False) -> np.ndarray:
    """`rotate` in NumPy (its twin: the tests hold the kernel to these bits)."""
    half = cos.shape[1]
    first, second = _pair_slices(_mode(mode), half)
    c = cos[:, None, :]
    s = -sin[:, None, :] if inverse else sin[:, None, :]
    a, b = x[..., first], x[..., second]
    out = x.copy()
    out[..., first] = a * c - b * s
    out[..., second] = a * s + b * c
    return out


def apply_rope(
    x: np.ndarray,
    positions,
    *,
    theta: float = 10000.0,
    n_rot: int | None = None,
    mode: str = "normal",
    freq_factors=None,
    freq_scale: float = 1.0,
    inverse: bool = False,
    out=None,
) -> np.ndarray:
    """x: (T, H, hd) float32, positions: (T,) int -> (T, H, hd) float32, rotated by position.

    `n_rot` defaults to head_dim. For repeated calls with one config (Q and K of every layer),
    build `rope_freqs` once and call `rope_cos_sin` + `rotate` instead.
    """
    if not isinstance(x, np.ndarray) or x.ndim != 3:
        raise DimensionError(f"x must be (T, H, head_dim), got {getattr(x, 'shape', type(x))}")
    n_rot = x.shape[2] if n_rot is None else n_rot
    if isinstance(n_rot, int) and n_rot > x.shape[2]:
        raise DimensionError(f"n_rot {n_rot} exceeds head_dim {x.shape[2]}")
    pos = _positions(positions)
    if pos.shape[0] != x.shape[0]:
        raise DimensionError(f"{pos.shape[0]} positions for {x.shape[0]} tokens")
    freqs = rope_freqs(n_rot, theta=theta, freq_factors=freq_factors, freq_scale=freq_scale)
    cos, sin = rope_cos_sin(pos, freqs)
    return rotate(x, cos, sin, mode=mode, inverse=inverse, out=out)
