"""Elementwise activations: silu, gelu (tanh approximation), swiglu, geglu, softcap.

Each public function checks its inputs and runs a numba loop over the flattened array; every
loop has a NumPy twin (`*_numpy`, same arguments) used as the reference in tests. The loops
call scalar libm `expf`/`tanhf` per element, so an element's result depends only on its value,
never on the array's length, layout or position (batch invariance). Formulas and evaluation
order follow ggml (`x / (1 + exp(-x))`, `0.5*x*(1 + tanh(sqrt(2/pi)*x*(1 + 0.044715*x*x)))`).
Arithmetic stays in float32. It holds no normalization and no matmul.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.ops._checks import as_f32, out_buffer

_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_GELU_A = np.float32(0.044715)
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)


@njit(cache=True, nogil=True)
def _silu1(v):
    """One float32 value: v / (1 + exp(-v))."""
    return v / (_ONE + np.exp(-v))


@njit(cache=True, nogil=True)
def _gelu1(v):
    """One float32 value: 0.5*v*(1 + tanh(sqrt(2/pi)*v*(1 + 0.044715*v*v)))."""
    return _HALF * v * (_ONE + np.tanh(_SQRT_2_OVER_PI * v * (_ONE + _GELU_A * v * v)))


@njit(cache=True, nogil=True)
def _silu_kernel(x, out):
    """x, out: (N,) f32."""
    for i in range(x.size):
        out[i] = _silu1(x[i])


@njit(cache=True, nogil=True)
def _gelu_kernel(x, out):
    """x, out: (N,) f32."""
    for i in range(x.size):
        out[i] = _gelu1(x[i])


@njit(cache=True, nogil=True)
def _swiglu_kernel(gate, up, out):
    """gate, up, out: (N,) f32; silu(gate) * up."""
    for i in range(gate.size):
        out[i] = _silu1(gate[i]) * up[i]


@njit(cache=True, nogil=True)
def _geglu_kernel(gate, up, out):
    """gate, up, out: (N,) f32; gelu(gate) * up."""
    for i in range(gate.size):
        out[i] = _gelu1(gate[i]) * up[i]


@njit(cache=True, nogil=True)
def _softcap_kernel(x, inv_cap, cap, out):
    """x, out: (N,) f32; inv_cap, cap: f32 scalars; tanh(x * (1/cap)) * cap as in ggml."""
    for i in range(x.size):
        out[i] = np.tanh(x[i] * inv_cap) * cap


def silu_numpy(x, out):
    """NumPy twin of `_silu_kernel`."""
    with np.errstate(over="ignore"):
        np.divide(x, _ONE + np.exp(-x), out=out)


def gelu_numpy(x, out):
    """NumPy twin of `_gelu_kernel`."""
    np.multiply(_HALF * x, _ONE + np.tanh(_SQRT_2_OVER_PI * x * (_ONE + _GELU_A * x * x)), out=out)


def swiglu_numpy(gate, up, out):
    """NumPy twin of `_swiglu_kernel`."""
    silu_numpy(gate, out)
    np.multiply(out, up, out=out)


def geglu_numpy(gate, up, out):
    """NumPy twin of `_geglu_kernel`."""
    gelu_numpy(gate, out)
    np.multiply(out, up, out=out)


def softcap_numpy(x, inv_cap, cap, out):
    """NumPy twin of `_softcap_kernel`."""
    np.multiply(np.tanh(x * inv_cap), cap, out=out)


def _unary(kernel, x, out):
    x = as_f32("x", x)
    out = out_buffer(out, x.shape)
    kernel(x.reshape(-1), out.reshape(-1))
    return out


def _gated(kernel, gate, up, out):
    gate = as_f32("gate", gate)
    up = as_f32("up", up)
    if gate.shape != up.shape:
        raise DimensionError(f"gate shape {gate.shape} differs from up shape {up.shape}")
    out = out_buffer(out, gate.shape)
    kernel(gate.reshape(-1), up.reshape(-1), out.reshape(-1))
    return out


def silu(x: np.ndarray, *, out=None) -> np.ndarray:
    """x: (...) float32 -> (...) float32: x * sigmoid(x)."""
    return _unary(_silu_kernel, x, out)


def gelu(x: np.ndarray, *, out=None) -> np.ndarray:
    """x: (...) float32 -> (...) float32: GELU, tanh approximation."""
    return _unary(_gelu_kernel, x, out)


def swiglu(gate: np.ndarray, up: np.ndarray, *, out=None) -> np.ndarray:
    """gate, up: (...) float32, same shape -> (...) float32: silu(gate) * up."""
    return _gated(_swiglu_kernel, gate, up, out)


def geglu(gate: np.ndarray, up: np.ndarray, *, out=None) -> np.ndarray:
    """gate, up: (...) float32, same shape -> (...) float32: gelu(gate) * up."""
    return _gated(_geglu_kernel, gate, up, out)


def softcap(x: np.ndarray, cap: float, *, out=None) -> np.ndarray:
    """x: (...) float32, cap > 0 -> (...) float32: cap * tanh(x / cap), values in (-cap, cap)."""
    if not (math.isfinite(cap) and cap > 0.0):
        raise ConfigError("cap", f"must be a finite number > 0, got {cap}")
    x = as_f32("x", x)
    out = out_buffer(out, x.shape)
    cap32 = np.float32(cap)
    _softcap_kernel(x.reshape(-1), _ONE / cap32, cap32, out.reshape(-1))
    return out
