"""Elementwise activations: silu, gelu (tanh approximation), swiglu, geglu, softcap.

Each public function checks its inputs and runs a numba loop over the flattened array; every
loop has a NumPy twin (`*_numpy`, same arguments) used as the reference in tests. silu and gelu
use this module's exp and tanh (`exp32`, `tanh32`: Cephes' single-precision polynomials, a
few ulp from the true value), written in plain float32 arithmetic and bit operations, so the
loops vectorize (libm's scalar expf/tanhf took a fifth of a Gemma prefill) and the NumPy twins
give the same bits. An element's result depends only on its value, never on the array's
length, layout or position (batch invariance). Formulas and evaluation order follow ggml
(`x / (1 + exp(-x))`, `0.5*x*(1 + tanh(sqrt(2/pi)*x*(1 + 0.044715*x*x)))`); softcap keeps
libm's tanh (not on a hot path). The loops take numba's NumPy error model: a division by zero
gives inf or NaN as IEEE says instead of a Python exception check, which kept them scalar.
Arithmetic stays in float32. It holds no normalization and no
matmul.

Outside the guarantee, by design: exp32 returns inf above 88 and 0 below -87 (libm: finite up
to 88.72, subnormal down to -103.97), which moves silu(x) for x < -88 from about -1e-36 to -0.0
and nothing else.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.ops._checks import as_f32, out_buffer

_ONE = np.float32(1.0)
_TWO = np.float32(2.0)
_HALF = np.float32(0.5)
_GELU_A = np.float32(0.044715)
_SQRT_2_OVER_PI = np.float32(0.7978845608028654)

# exp32 (Cephes expf): x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-7 polynomial, 2^n on
# the exponent bits
_EXP_HI, _EXP_LO = np.float32(88.0), np.float32(-87.0)  # 2^n stays a normal float32
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_P = tuple(np.float32(c) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3,
                                       4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
_INF = np.float32(np.inf)
_ZERO = np.float32(0.0)
# tanh32 (Cephes tanhf): an odd polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above
_TANH_SMALL = np.float32(0.625)
_TANH_P = tuple(np.float32(c) for c in (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2,
                                        1.33314422036e-1, -3.33332819422e-1))


def pow2_ir(builder, n):
    """IR for 2.0 ** n as float32 from int32 n, a scalar or a vector of them, n in -126..127:
    the exponent bits (n + 127) << 23 (`_pow2`, and exp32's vector twin in fold_blocks.py)."""
    t = n.type
    if isinstance(t, ir.VectorType):
        def const(x):
            return ir.Constant(t, [x] * t.count)
        f32 = ir.VectorType(ir.FloatType(), t.count)
    else:
        def const(x):
            return ir.Constant(t, x)
        f32 = ir.FloatType()
    return builder.bitcast(builder.shl(builder.add(n, const(127)), const(23)), f32)


@intrinsic
def _pow2(typingctx, n):
    """2.0 ** n as float32 for an integer n in -126..127 (`pow2_ir`)."""
    if not isinstance(n, types.Integer):
        return None

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        v = builder.trunc(args[0], i32) if n.bitwidth > 32 else builder.sext(args[0], i32) \
            if n.bitwidth < 32 else args[0]
        return pow2_ir(builder, v)

    return types.float32(n), codegen


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def exp32(x):
    """exp of one float32 value (module docstring: inf above 88, 0 below -87, NaN for NaN)."""
    xc = _EXP_HI if x > _EXP_HI else x
    xc = _EXP_LO if xc < _EXP_LO else xc
    fn = np.rint(xc * _LOG2E)
    r = (xc - fn * _LN2_HI) - fn * _LN2_LO
    p = _EXP_P[0]
    p = p * r + _EXP_P[1]
    p = p * r + _EXP_P[2]
    p = p * r + _EXP_P[3]
    p = p * r + _EXP_P[4]
    p = p * r + _EXP_P[5]
    y = (p * (r * r) + r) + _ONE
    y = y * _pow2(np.int32(fn if fn == fn else _ZERO))  # NaN: n = 0, y stays NaN
    y = _INF if x > _EXP_HI else y
    return _ZERO if x < _EXP_LO else y


@njit(cache=True, nogil=True, inline="always", error_model="numpy")
def tanh32(x):
    """tanh of one float32 value (Cephes tanhf; NaN for NaN, +-1 for +-inf)."""
    a = abs(x)
    z = x * x
    p = _TANH_P[0]
    p = p * z + _TANH_P[1]
    p = p * z + _TANH_P[2]
    p = p * z + _TANH_P[3]
    p = p * z + _TANH_P[4]
    small = (p * z) * x + x
    big = _ONE - _TWO / (exp32(a + a) + _ONE)
    big = -big if x < _ZERO else big
    return small if a < _TANH_SMALL else big


def exp32_numpy(x: np.ndarray) -> np.ndarray:
    """The NumPy twin of exp32, elementwise, bit for bit."""
    x = np.asarray(x, dtype=np.float32)
    xc = np.where(x > _EXP_HI, _EXP_HI, x)
    xc = np.where(xc < _EXP_LO, _EXP_LO, xc).astype(np.float32)
    fn = np.rint(xc * _LOG2E)
    r = (xc - fn * _LN2_HI) - fn * _LN2_LO
    p = np.full_like(r, _EXP_P[0])
    for c in _EXP_P[1:]:
        p = p * r + c
    y = (p * (r * r) + r) + _ONE
    n = np.where(fn == fn, fn, _ZERO).astype(np.int32)
    y = y * ((n + np.int32(127)) << np.int32(23)).view(np.float32)
    y = np.where(x > _EXP_HI, _INF, y)
    return np.where(x < _EXP_LO, _ZERO, y).astype(np.float32)


def tanh32_numpy(x: np.ndarray) -> np.ndarray:
    """The NumPy twin of tanh32, elementwise, bit for bit."""
    x = np.asarray(x, dtype=np.float32)
    a = np.abs(x)
    z = x * x
    p = np.full_like(z, _TANH_P[0])
    for c in _TANH_P[1:]:
        p = p * z + c
    small = (p * z) * x + x
    with np.errstate(over="ignore"):
        big = _ONE - _TWO / (exp32_numpy(a + a) + _ONE)
    big = np.where(x < _ZERO, -big, big)
    return np.where(a < _TANH_SMALL, small, big).astype(np.float32)


@njit(cache=True, nogil=True, error_model="numpy")
def _silu1(v):
    """One float32 value: v / (1 + exp(-v))."""
    return v / (_ONE + exp32(-v))


@njit(cache=True, nogil=True, error_model="numpy")
def _gelu1(v):
    """One float32 value: 0.5*v*(1 + tanh(sqrt(2/pi)*v*(1 + 0.044715*v*v)))."""
    return _HALF * v * (_ONE + tanh32(_SQRT_2_OVER_PI * v * (_ONE + _GELU_A * v * v)))


@njit(cache=True, nogil=True, error_model="numpy")
def _silu_kernel(x, out):
    """x, out: (N,) f32."""
    for i in range(x.size):
        out[i] = _silu1(x[i])


@njit(cache=True, nogil=True, error_model="numpy")
def _gelu_kernel(x, out):
    """x, out: (N,) f32."""
    for i in range(x.size):
        out[i] = _gelu1(x[i])


@njit(cache=True, nogil=True, error_model="numpy")
def _swiglu_kernel(gate, up, out):
    """gate, up, out: (N,) f32; silu(gate) * up."""
    for i in range(gate.size):
        out[i] = _silu1(gate[i]) * up[i]


@njit(cache=True, nogil=True, error_model="numpy")
def _geglu_kernel(gate, up, out):
    """gate, up, out: (N,) f32; gelu(gate) * up."""
    for i in range(gate.size):
        out[i] = _gelu1(gate[i]) * up[i]


@njit(cache=True, nogil=True, error_model="numpy", inline="always")
def _gated_row(gu, gelu, out, t):
    """Row t: `_swiglu_kernel` / `_geglu_kernel` on its halves (contiguous slices, so the
    loops vectorize as they do on whole arrays)."""
    hid = out.shape[1]
    if gelu:
        _geglu_kernel(gu[t, :hid], gu[t, hid:], out[t])
    else:
        _swiglu_kernel(gu[t, :hid], gu[t, hid:], out[t])


@njit(cache=True, nogil=True, error_model="numpy")
def _gated_halves_kernel(gu, gelu, out):
    """gu (T, 2H) f32 rows [gate | up], out (T, H) f32: act(gate) * up, act gelu if gelu
    else silu, row by row (`_gated_row`)."""
    for t in range(out.shape[0]):
        _gated_row(gu, gelu, out, t)


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _gated_halves_parallel(gu, gelu, out):
    """`_gated_halves_kernel` with the rows split between threads (each row the same loops,
    so the same bits): a prompt chunk's (256, 2 x 1,536) took ~320 us on one thread."""
    for t in prange(out.shape[0]):
        _gated_row(gu, gelu, out, np.int64(t))


# From this many outputs a call splits its rows between threads (as ops.norm's rule)
PARALLEL_ELEMENTS = 1 << 16


@njit(cache=True, nogil=True)
def _softcap_kernel(x, inv_cap, cap, out):
    """x, out: (N,) f32; inv_cap, cap: f32 scalars; tanh(x * (1/cap)) * cap as in ggml."""
    for i in range(x.size):
        out[i] = np.tanh(x[i] * inv_cap) * cap


def silu_numpy(x, out):
    """NumPy twin of `_silu_kernel`."""
    with np.errstate(over="ignore"):
        np.divide(x, _ONE + exp32_numpy(-x), out=out)


def gelu_numpy(x, out):
    """NumPy twin of `_gelu_kernel`."""
    np.multiply(_HALF * x, _ONE + tanh32_numpy(_SQRT_2_OVER_PI * x * (_ONE + _GELU_A * x * x)),
                out=out)


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


def gated_halves(gu: np.ndarray, *, gelu: bool = False, out=None) -> np.ndarray:
    """gu: (T, 2H) float32, each row [gate | up] (a fused gate|up product) -> (T, H) float32:
    silu(gate) * up (SwiGLU), or gelu(gate) * up with gelu=True (GeGLU). Bitwise `swiglu` /
    `geglu` of the two halves, read in place: slicing the halves and passing them to those
    copied both (non-contiguous views): one (256, 2 x 1536) call 200 us against 320."""
    gu = as_f32("gu", gu, 2)
    if gu.shape[1] % 2:
        raise DimensionError(f"gu must have an even number of columns [gate | up], got {gu.shape}")
    out = out_buffer(out, (gu.shape[0], gu.shape[1] // 2))
    kernel = _gated_halves_parallel if out.size >= PARALLEL_ELEMENTS else _gated_halves_kernel
    kernel(gu, bool(gelu), out)
    return out


def softcap(x: np.ndarray, cap: float, *, out=None) -> np.ndarray:
    """x: (...) float32, cap > 0 -> (...) float32: cap * tanh(x / cap), values in (-cap, cap)."""
    if not (math.isfinite(cap) and cap > 0.0):
        raise ConfigError("cap", f"must be a finite number > 0, got {cap}")
    x = as_f32("x", x)
    out = out_buffer(out, x.shape)
    cap32 = np.float32(cap)
    _softcap_kernel(x.reshape(-1), _ONE / cap32, cap32, out.reshape(-1))
    return out
