"""F32, F16 and BF16 matrices behind the same codec interface as the block formats: decoding
bitwise equal to gguf-py, row tiles that keep the stored width (4 or 2 bytes per weight; the
16-bit kernel widens one tile at a time into per-thread scratch), a numba kernel per element
width and the NumPy twin, all in the reduction order of tiles.py.

Not here: BLAS (its kernel choice depends on T, which would break batch invariance), shape checks
(weight.py), 1-D tensors such as norms (the model reads those itself).
"""

# F32: 4 bytes per weight, IEEE binary32 little-endian. F16: 2 bytes, binary16 (sign, 5-bit
# exponent biased 15, 10-bit mantissa). BF16: 2 bytes, the high half of a binary32. Rows are
# zero-padded to a multiple of FLOAT_BLOCK columns in the tiles; x is padded to match per call.

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from cfr_atlas.quant.formats import Codec, QType
from cfr_atlas.quant.tiles import (
    FLOAT_BLOCK,
    PHASES,
    TILE_ROWS,
    gather_rows,
    phase_sum,
    phase_view,
    to_tiles,
)

QK = FLOAT_BLOCK
R = TILE_ROWS
ELEMENT = {QType.F32: np.dtype("<f4"), QType.F16: np.dtype("<u2"), QType.BF16: np.dtype("<u2")}


class Tiles(NamedTuple):
    w: np.ndarray  # (n_tiles, K_pad * TILE_ROWS): float32 (F32) or uint16 bits (F16, BF16)
    cols: int  # K; columns K .. K_pad - 1 are zeros


class HalfSpec(NamedTuple):
    """How the kernel widens 16-bit bits h to a float32 without a float16 type (numba has none):
    bits = sign << 16 | (h & 0x7FFF) << shift | (all-ones exponent -> binary32 inf/NaN), then
    times scale, which re-biases the exponent exactly (2**(127 - 15) for binary16: subnormals
    become binary32 subnormals first, so this assumes no denormals-are-zero mode)."""

    shift: np.uint32
    special: np.uint32  # the format's exponent mask
    scale: np.float32


HALF_SPECS = {
    QType.F16: HalfSpec(np.uint32(13), np.uint32(0x7C00), np.float32(2.0**112)),
    QType.BF16: HalfSpec(np.uint32(16), np.uint32(0x7F80), np.float32(1.0)),
}

# Rounding facts: every binary16 and bfloat16 value is exactly a binary32 value, so decoding
# rounds nothing (NumPy's float16 -> float32 cast and gguf-py's `<< 16` agree bit for bit).


def _values(qtype: QType, e: np.ndarray) -> np.ndarray:
    """Stored elements e (any shape) -> float32 values, exact."""
    if qtype is QType.F16:
        return e.view("<f2").astype(np.float32)
    if qtype is QType.BF16:
        return (e.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return e.astype(np.float32)


def _dequantize(qtype: QType, raw: np.ndarray) -> np.ndarray:
    """raw (rows, row_bytes) uint8 -> (rows, cols) float32, bitwise equal to gguf-py."""
    return _values(qtype, np.ascontiguousarray(raw).view(ELEMENT[qtype]))


def _repack(qtype: QType, raw: np.ndarray) -> Tiles:
    """raw (N, row_bytes) uint8 -> Tiles holding the stored elements, columns padded to QK."""
    e = np.ascontiguousarray(raw).view(ELEMENT[qtype])
    rows, cols = e.shape
    padded = np.zeros((rows, -(-cols // QK) * QK), dtype=e.dtype)
    padded[:, :cols] = e
    return Tiles(to_tiles(padded), cols)


def _unpack_rows(qtype: QType, tiles: Tiles, ids: np.ndarray | slice,
                 out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the matrix, (len(ids), K) float32, equal to dequantize(raw)[ids]."""
    rows = _values(qtype, gather_rows(tiles.w, ids)[:, :tiles.cols])
    if out is None:
        return rows
    out[:] = rows
    return out


def _padded(x: np.ndarray, tiles: Tiles) -> np.ndarray:
    """x (T, K) -> (T, K_pad) with zero columns; x itself when K is already a multiple of QK."""
    cols = tiles.w.shape[1] // R
    if x.shape[1] == cols:
        return x
    xp = np.zeros((x.shape[0], cols), dtype=np.float32)
    xp[:, :x.shape[1]] = x
    return xp


@njit(cache=True, inline="always")
def _half(h, shift, special, scale):
    """16-bit bits h -> float32 per HalfSpec; exact for every finite value and for inf."""
    bits = np.uint32(h)
    sign = (bits & np.uint32(0x8000)) << np.uint32(16)
    body = (bits & np.uint32(0x7FFF)) << shift
    inf_nan = np.uint32((bits & special) == special) * np.uint32(0x7F800000)
    return np.uint32(sign | body | inf_nan).view(np.float32) * scale


@njit(cache=True, inline="always")
def _tile_f32(w, x, acc):
    """acc (R,) = one float32 tile w (K_pad * R,) times one token x (K_pad,)."""
    acc[:] = 0
    for b in range(x.shape[0] // QK):
        k0 = b * QK
        for r in range(R):  # vectorized across the tile's rows; each row a scalar chain
            o = k0 * R + r
            s0 = w[o] * x[k0]
            s1 = w[o + R] * x[k0 + 1]
            s2 = w[o + 2 * R] * x[k0 + 2]
            s3 = w[o + 3 * R] * x[k0 + 3]
            for k in range(PHASES, QK, PHASES):
                ok = o + k * R
                s0 += w[ok] * x[k0 + k]
                s1 += w[ok + R] * x[k0 + k + 1]
                s2 += w[ok + 2 * R] * x[k0 + k + 2]
                s3 += w[ok + 3 * R] * x[k0 + k + 3]
            acc[r] += (s0 + s1) + (s2 + s3)


@njit(parallel=True, cache=True, nogil=True)
def _f32_kernel(x, w, out):
    """x (T, K_pad) float32, float32 tiles w -> out (T, N) float32; threads split the tiles."""
    N = out.shape[1]
    for i in prange(w.shape[0]):
        acc = np.empty(R, dtype=np.float32)
        n0 = i * R
        lanes = min(R, N - n0)
        for t in range(x.shape[0]):
            _tile_f32(w[i], x[t], acc)
            out[t, n0:n0 + lanes] = acc[:lanes]


@njit(parallel=True, cache=True, nogil=True)
def _half_kernel(x, w, shift, special, scale, out):
    """x (T, K_pad) float32, 16-bit tiles w -> out (T, N) float32; threads split the tiles.
    Each tile is widened once into a float32 scratch (exact), then read as an F32 tile."""
    N = out.shape[1]
    for i in prange(w.shape[0]):
        acc = np.empty(R, dtype=np.float32)
        wi = w[i]
        wide = np.empty(wi.shape[0], dtype=np.float32)
        for j in range(wi.shape[0]):
            wide[j] = _half(wi[j], shift, special, scale)
        n0 = i * R
        lanes = min(R, N - n0)
        for t in range(x.shape[0]):
            _tile_f32(wide, x[t], acc)
            out[t, n0:n0 + lanes] = acc[:lanes]


def _matmul(qtype: QType, x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T with the numba kernel; inputs already checked."""
    if qtype is QType.F32:
        _f32_kernel(_padded(x, tiles), tiles.w, out)
    else:
        _half_kernel(_padded(x, tiles), tiles.w, *HALF_SPECS[qtype], out)


def _matmul_numpy(qtype: QType, x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """The NumPy twin of `_matmul`: the same float32 operations in the same order, vectorized."""
    T, N = out.shape
    xb = phase_view(_padded(x, tiles), QK)  # (T, nb, steps, PHASES)
    w = phase_view(_values(qtype, tiles.w).reshape(tiles.w.shape[0], -1, R).transpose(0, 2, 1),
                   QK).transpose(0, 2, 3, 4, 1)  # (n_tiles, nb, steps, PHASES, R)
    acc = np.zeros((T, w.shape[0], R), dtype=np.float32)
    for b in range(w.shape[1]):
        acc = acc + phase_sum(w[None, :, b] * xb[:, None, b, :, :, None])
    out[:] = acc.reshape(T, -1)[:, :N]


def _codec(qtype: QType, raw_dtype: type) -> Codec:
    return Codec(qtype, np.dtype(raw_dtype), partial(_dequantize, qtype), partial(_repack, qtype),
                 partial(_unpack_rows, qtype), partial(_matmul, qtype),
                 partial(_matmul_numpy, qtype))


CODECS = (_codec(QType.F32, np.float32), _codec(QType.F16, np.float16),
          _codec(QType.BF16, np.uint16))
