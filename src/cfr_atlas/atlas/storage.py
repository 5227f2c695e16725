"""K/V storage dtypes: how float32 rows are rounded on write and widened on read.

Rows are computed in float32 and rounded once, on write, to the storage dtype. Every path that
stores rows (the full-K/V write, the hot cache, scratch after regeneration) calls `round_rows`,
so a page's stored bits never depend on where it came from.

numba has no float16 type on the CPU and NumPy has no bfloat16, so both 16-bit formats are kept
as their raw uint16 bit patterns. Kernels read them directly through `to_f32(bits, fmt)`: on a
CPU with F16C a float16 element is one `fpext half -> float` (vcvtph2ps), a bfloat16 element a
16-bit shift; `fmt` is a typed marker (`FORMATS[dtype]`), so each format compiles to its own
straight-line loop. Widening is exact for both formats; rounding is round-to-nearest-even.
This module does not hold any cache or attention logic.
"""

from __future__ import annotations

import enum

import llvmlite.binding as llvm
import numpy as np
from llvmlite import ir
from numba import config, njit, types
from numba.extending import intrinsic, overload


class StorageDtype(enum.Enum):
    """Storage format of K/V rows; `.code` is what the numba kernels branch on."""

    FLOAT32 = "float32"
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"

    @property
    def code(self) -> int:
        return _CODES[self]

    @property
    def itemsize(self) -> int:
        return 4 if self is StorageDtype.FLOAT32 else 2

    @property
    def array_dtype(self) -> np.dtype:
        """NumPy dtype of arrays holding this format (uint16 bit patterns for 16-bit formats)."""
        return np.dtype(np.float32) if self is StorageDtype.FLOAT32 else np.dtype(np.uint16)


_CODES = {StorageDtype.FLOAT32: 0, StorageDtype.FLOAT16: 1, StorageDtype.BFLOAT16: 2}

# The K/V storage of every user-facing sequence (Session, Model, CLI, server) unless asked
# otherwise: half the bytes of float32, and 8x closer to float32 logits than bfloat16 on the
# bundled model (docs/CONFORMANCE.md). `AtlasConfig`, the low-level runtime config, keeps
# float32 as its own default; its callers in the package always pass a dtype.
DEFAULT_STORAGE_DTYPE = StorageDtype.FLOAT16.value


def round_rows(rows: np.ndarray, dtype: StorageDtype, out: np.ndarray | None = None) -> np.ndarray:
    """rows: (..., D) float32 -> same shape in `dtype.array_dtype`, rounded to nearest even."""
    rows = np.asarray(rows, dtype=np.float32)
    if dtype is StorageDtype.FLOAT32:
        result = rows
    elif dtype is StorageDtype.FLOAT16:
        result = rows.astype(np.float16).view(np.uint16)
    else:
        # bfloat16 = the top 16 bits of float32, rounded to nearest even on the 16 dropped bits.
        # Inputs are finite (checked before any write), so the carry never produces a NaN.
        bits = rows.view(np.uint32)
        lsb = (bits >> np.uint32(16)) & np.uint32(1)
        result = ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)
    if out is None:
        return np.array(result, dtype=dtype.array_dtype, copy=result is rows)
    out[...] = result
    return out


def widen(stored: np.ndarray, dtype: StorageDtype) -> np.ndarray:
    """stored: (..., D) in `dtype.array_dtype` -> float32 copy (exact)."""
    out = np.empty(stored.shape, dtype=np.float32)
    if out.size == 0:  # e.g. the (n, 0) V rows of a K/V stream whose V is a view of K
        return out
    widen_into(stored.reshape(-1, stored.shape[-1]) if stored.ndim else stored.reshape(1, 1),
               format_of(dtype), out.reshape(-1, out.shape[-1]) if out.ndim else out.reshape(1, 1))
    return out


_TWO_POW_112 = np.float32(2.0**112)  # rebias: float16 exponent bias 15 -> float32 bias 127
# numba compiles for the host unless NUMBA_CPU_NAME / NUMBA_CPU_FEATURES say otherwise
_TARGET_FEATURES = (config.CPU_FEATURES if config.CPU_NAME else
                    llvm.get_host_cpu_features().flatten())
HAS_F16C = "+f16c" in (_TARGET_FEATURES or "").split(",")


@intrinsic
def _f16_fpext(typingctx, bits):
    """uint16 float16 bits -> float32 by LLVM's fpext (vcvtph2ps with F16C): exact."""
    def codegen(context, builder, signature, args):
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def bf16_to_f32(typingctx, bits):
    """uint16 bfloat16 bits -> float32: the bits become the top half of a float32 (exact)."""
    def codegen(context, builder, signature, args):
        wide = builder.shl(builder.zext(args[0], ir.IntType(32)), ir.Constant(ir.IntType(32), 16))
        return builder.bitcast(wide, ir.FloatType())
    return types.float32(types.uint16), codegen


@intrinsic
def _u32_as_f32(typingctx, bits):
    """uint32 bits -> the float32 with those bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return types.float32(types.uint32), codegen


@njit(cache=True, inline="always")
def _f16_soft(h):
    """The same conversion without F16C, from the bits (exact for normals and subnormals:
    the 15 bits under float32's exponent field, scaled by 2**112, a power of two)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    em = h & np.uint32(0x7FFF)
    if em >= 0x7C00:  # inf / nan keep their payload
        return _u32_as_f32(np.uint32(sign | np.uint32(0x7F800000)
                                     | ((em & np.uint32(0x3FF)) << np.uint32(13))))
    mag = _u32_as_f32(np.uint32(em << np.uint32(13))) * _TWO_POW_112
    return -mag if sign else mag


f16_to_f32 = _f16_fpext if HAS_F16C else _f16_soft

# Typed markers selecting the element format inside kernels (the arrays of both 16-bit formats
# are uint16; the marker's type says which one): FORMATS[dtype.code].
FORMATS = (np.float32(0), np.uint16(0), np.int16(0))


def to_f32(x, fmt):
    """One stored element -> float32 (exact), the format given by the type of `fmt`."""
    raise NotImplementedError("to_f32 is only callable from numba kernels")


@overload(to_f32, jit_options={"cache": True}, inline="always")
def _to_f32_ov(x, fmt):
    if isinstance(fmt, types.Float):
        return lambda x, fmt: x
    if fmt == types.uint16:
        return lambda x, fmt: f16_to_f32(x)
    return lambda x, fmt: bf16_to_f32(x)


def format_of(dtype: StorageDtype):
    """The kernel marker of a storage dtype."""
    return FORMATS[dtype.code]


@njit(cache=True, nogil=True)
def widen_into(stored, fmt, out):
    """stored: (n, D) float32 or uint16 bits, fmt: `FORMATS[code]` -> out (n, D) float32."""
    n, d = stored.shape
    for i in range(n):
        for j in range(d):
            out[i, j] = to_f32(stored[i, j], fmt)


@njit(cache=True, nogil=True)
def stage_f32(k_rows, v_rows, kt_out, v_out):
    """float32 storage: copy rows (n, D) into a scratch page, K transposed (D, n), V as rows;
    returns False if any value is not finite (all-ones exponent), the caller then raises."""
    n, d = k_rows.shape
    dv = v_rows.shape[1]  # d, or 0 when V is a view of K
    kb, vb = k_rows.view(np.uint32), v_rows.view(np.uint32)
    exp_mask = np.uint32(0x7F800000)
    bad = np.uint32(0)
    for j in range(n):
        for e in range(d):  # an integer OR-reduction: vectorizes, and it is exact
            bad |= np.uint32((kb[j, e] & exp_mask) == exp_mask)
        for e in range(dv):
            bad |= np.uint32((vb[j, e] & exp_mask) == exp_mask)
    for e in range(d):
        for j in range(n):
            kt_out[e, j] = k_rows[j, e]
    v_out[:, :] = v_rows
    return bad == 0


_TWO_POW_24 = np.float32(2.0**24)  # float16's subnormal unit is 2**-24


@intrinsic
def _f32_bits(typingctx, x):
    """float32 -> its uint32 bits."""
    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))
    return types.uint32(types.float32), codegen


def _round1(x, fmt):
    raise NotImplementedError("only callable from numba kernels")


@overload(_round1, jit_options={"cache": True}, inline="always")
def _round1_ov(x, fmt):
    """One finite float32 -> its stored element, as `round_rows` rounds it (nearest even).
    float16 from the bits: a normal result drops 13 mantissa bits with the carry of round half
    to even (a carry into the exponent is the next binade, as NumPy's cast gives); at 65,520
    and above infinity; below 2**-14 (float16 subnormals and zero) |x| * 2**24 is exact and
    rint rounds it half to even, 1024 being 2**-14 itself. Non-finite inputs give patterns
    of no meaning (a bfloat16 NaN may even become -0.0): callers check the float32 rows, as
    `round_checked` does through `storable`."""
    if isinstance(fmt, types.Float):
        return lambda x, fmt: x
    if fmt == types.uint16:
        def f16(x, fmt):
            b = _f32_bits(x)
            sign = np.uint16((b >> np.uint32(16)) & np.uint32(0x8000))
            em = b & np.uint32(0x7FFFFFFF)
            if em >= np.uint32(0x477FF000):  # 65,520 rounds to inf; inf and NaN stay so
                return sign | np.uint16(0x7C00 if em <= np.uint32(0x7F800000) else 0x7E00)
            if em >= np.uint32(0x38800000):  # a float16 normal: rebias 127 -> 15
                m = em - np.uint32(0x38000000)
                return sign | np.uint16((m + np.uint32(0xFFF) + ((m >> np.uint32(13))
                                                                 & np.uint32(1))) >> np.uint32(13))
            return sign | np.uint16(np.rint(abs(x) * _TWO_POW_24))
        return f16

    def bf16(x, fmt):
        b = _f32_bits(x)
        lsb = (b >> np.uint32(16)) & np.uint32(1)
        return np.uint16((b + np.uint32(0x7FFF) + lsb) >> np.uint32(16))
    return bf16


@njit(cache=True, nogil=True)
def round_checked(rows, fmt, out) -> bool:
    """rows (float32, C-contiguous) -> out (the same shape, the format's array dtype) rounded
    as `round_rows` rounds them; returns `storable(rows, out, fmt)` (False: the caller's own
    checks then say what is wrong). One pass, for the decode step's few rows."""
    src, dst = rows.ravel(), out.ravel()
    for i in range(src.size):
        dst[i] = _round1(src[i], fmt)
    return storable(rows, out, fmt)


def _overflowed(stored, fmt):
    raise NotImplementedError("only callable from numba kernels")


@overload(_overflowed, jit_options={"cache": True}, inline="always")
def _overflowed_ov(stored, fmt):
    """Whether a 16-bit stored element is inf or NaN (its exponent field all ones); float32
    storage holds the rows themselves, checked already."""
    if isinstance(fmt, types.Float):
        return lambda stored, fmt: False
    mask = 0x7C00 if fmt == types.uint16 else 0x7F80  # float16, bfloat16

    def impl(stored, fmt):
        bits = stored.ravel()
        over = np.uint16(0)
        for i in range(bits.size):
            over |= np.uint16((bits[i] & np.uint16(mask)) == np.uint16(mask))
        return over != 0
    return impl


@njit(cache=True, nogil=True)
def storable(rows, stored, fmt) -> bool:
    """rows (float32, C-contiguous) and the same rows rounded to a storage format (`stored`,
    its array dtype): whether every row is finite and still finite once stored. Integer
    OR-reductions over the bits (they vectorize); the caller's own checks say what is wrong."""
    bits, exp = rows.ravel().view(np.uint32), np.uint32(0x7F800000)
    bad = np.uint32(0)
    for i in range(bits.size):
        bad |= np.uint32((bits[i] & exp) == exp)
    return bad == 0 and not _overflowed(stored, fmt)
