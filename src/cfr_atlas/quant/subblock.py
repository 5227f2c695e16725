"""Sub-block formats: the repacked layout, row reader, numba kernels and NumPy twin shared by
every format whose weights are w = a_s * q (+ c_s), an integer q with a float32 scale a_s (and
offset c_s) per sub-block s of QK consecutive columns of one row.

That covers Q8_0, Q4_0 and Q4_1 (QK = 32, their own fast repacks, q8_0.py, q4_0.py, q4_1.py),
Q5_0, Q5_1 and IQ4_NL (QK = 32, one sub-block per block, q5.py), Q4_K and Q5_K
(QK = 32, eight per 256-element super-block) and Q2_K, Q3_K, Q6_K (QK = 16, sixteen per
super-block) (kquants.py). A format module only unpacks its bytes into `Fields`: the per-sub-block
a_s = d * sc_s (and c_s = dmin * m_s, subtracted, or the block's f16 m, added), computed once at
load time exactly as gguf-py computes them, and q as int8. Everything after that is here, once.

Layout (tiles.py): q in row tiles, int8, one byte per weight; a and c in row tiles with one
column per sub-block, float32. Formats without an offset (Q5_0, Q3_K, Q6_K, IQ4_NL) hold c as
an empty (n_tiles, 0) array.

Reduction order (tiles.py's contract with QK the sub-block size): per sub-block
S_s = phase sum of q * x (PHASES chains of QK / PHASES products, then (s0 + s1) + (s2 + s3)),
X_s = the same phase sum of x alone, term_s = a_s * S_s + c_s * X_s (or a_s * S_s), and
acc = acc + term_s over s in column order. The formats that subtract their offset store -c_s in
the tiles: negation is exact and round-to-nearest is symmetric, so a_s * S_s + (-c_s) * X_s is
a_s * S_s - c_s * X_s bit for bit. QK and the offset are compile-time constants of each kernel
(closure constants: numba's cache keys each of the four kernels by them, and LLVM sees fixed
trip counts, unrolls the phase loop and vectorizes across the tile's rows).

Not here: any format's byte layout (q5.py, kquants.py), shape checks (weight.py), quantization.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from functools import partial
from typing import NamedTuple

import numpy as np
from numba import njit, prange

from cfr_atlas.quant.formats import Codec, QType
from cfr_atlas.quant.tiles import PHASES, TILE_ROWS, gather_rows, phase_sum, phase_view, to_tiles

R = TILE_ROWS


class Offset(Enum):
    """How a format applies its sub-block offset c: w = a q, w = a q + c or w = a q - c."""

    NONE = 0
    ADD = 1  # Q5_1: c is the block's f16 m
    SUBTRACT = 2  # Q2_K, Q4_K, Q5_K: c = dmin * m_s


class Fields(NamedTuple):
    """A format's bytes unpacked: w[:, s * QK + j] = a[:, s] * q[:, s * QK + j] (+ or - c[:, s])."""

    a: np.ndarray  # (rows, n_sub) float32 sub-block scales
    c: np.ndarray | None  # (rows, n_sub) float32 sub-block offsets, None if the format has none
    q: np.ndarray  # (rows, n_sub * QK) int8 integer weights


class Tiles(NamedTuple):
    q: np.ndarray  # (n_tiles, K * TILE_ROWS) int8
    a: np.ndarray  # (n_tiles, K // QK * TILE_ROWS) float32 sub-block scales
    c: np.ndarray  # (n_tiles, K // QK * TILE_ROWS) float32 offsets as added (-c for SUBTRACT),
    #                or (n_tiles, 0) for Offset.NONE


def bit_fields(b: np.ndarray, width: int) -> np.ndarray:
    """b (..., L) uint8 -> (..., 8 // width, L) uint8: field i of byte j is (b[j] >> width * i)
    masked to `width` bits, so flattening the last two axes numbers the fields i * L + j (how
    ggml packs 1-, 2- and 4-bit quants: one bit plane per group of L bytes)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8)[:, None]
    return (b[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def values(a: np.ndarray, c: np.ndarray | None, q: np.ndarray, out: np.ndarray,
           offset: Offset) -> np.ndarray:
    """a, c (n, n_sub), q (n, n_sub * QK) -> out (n, n_sub * QK) float32 = (a * q) +/- c, the two
    NumPy operations gguf-py applies (a * q first, then the add or subtract: no fused
    multiply-add; subtracting c rather than adding -c keeps even NaN payloads gguf-py's)."""
    n, n_sub = a.shape
    qk = q.shape[1] // n_sub
    out3 = out.reshape(n, n_sub, qk)
    np.multiply(a[:, :, None], q.reshape(n, n_sub, qk), out=out3, dtype=np.float32)
    if offset is Offset.ADD:
        np.add(out3, c[:, :, None], out=out3)
    elif offset is Offset.SUBTRACT:
        np.subtract(out3, c[:, :, None], out=out3)
    return out


def _dequantize(fields: Callable[[np.ndarray], Fields], offset: Offset,
                raw: np.ndarray) -> np.ndarray:
    a, c, q = fields(raw)
    return values(a, c, q, np.empty(q.shape, dtype=np.float32), offset)


def _repack(fields: Callable[[np.ndarray], Fields], offset: Offset, raw: np.ndarray) -> Tiles:
    """The kernels always add c: SUBTRACT formats store -c (negation is exact)."""
    a, c, q = fields(raw)
    tiled_a = to_tiles(a)
    if offset is Offset.NONE:
        tiled_c = no_offsets(tiled_a)
    else:
        tiled_c = to_tiles(-c if offset is Offset.SUBTRACT else c)
    return Tiles(to_tiles(q), tiled_a, tiled_c)


def row_offsets(offset: Offset, c_tiles: np.ndarray, ids: np.ndarray | slice) -> np.ndarray | None:
    """Rows `ids` of the offsets c as the format defines them (None without offsets), from
    tiles holding what the kernels add: the repack's negation undone, -(-c) has c's bits."""
    if offset is Offset.NONE:
        return None
    c = gather_rows(c_tiles, ids)
    return -c if offset is Offset.SUBTRACT else c


def _unpack_rows(offset: Offset, tiles: Tiles, ids: np.ndarray | slice,
                 out: np.ndarray | None = None) -> np.ndarray:
    q, a = gather_rows(tiles.q, ids), gather_rows(tiles.a, ids)
    c = row_offsets(offset, tiles.c, ids)
    return values(a, c, q, np.empty(q.shape, dtype=np.float32) if out is None else out, offset)


@njit(cache=True, nogil=True)
def _block_sums(x, xsum, qk):
    """x (T, K) -> xsum (T, K // qk): each sub-block's sum of x in the phase order."""
    T, K = x.shape
    for t in range(T):
        for b in range(K // qk):
            k0 = b * qk
            p0, p1, p2, p3 = x[t, k0], x[t, k0 + 1], x[t, k0 + 2], x[t, k0 + 3]
            for k in range(k0 + PHASES, k0 + qk, PHASES):
                p0 += x[t, k]
                p1 += x[t, k + 1]
                p2 += x[t, k + 2]
                p3 += x[t, k + 3]
            xsum[t, b] = (p0 + p1) + (p2 + p3)


@njit(cache=True, inline="always")
def _tile_one(q, a, c, x, xsum, acc, qk, offset):
    """acc (R,) = one tile (q (K * R,), a, c (n_sub * R,)) times one token x (K,), xsum
    (n_sub,); qk and offset are the calling kernel's constants."""
    acc[:] = 0
    for b in range(x.shape[0] // qk):
        k0 = b * qk
        for r in range(R):  # vectorized across the tile's rows; each row a scalar chain
            o = k0 * R + r
            s0 = np.float32(q[o]) * x[k0]
            s1 = np.float32(q[o + R]) * x[k0 + 1]
            s2 = np.float32(q[o + 2 * R]) * x[k0 + 2]
            s3 = np.float32(q[o + 3 * R]) * x[k0 + 3]
            for k in range(PHASES, qk, PHASES):
                ok = o + k * R
                s0 += np.float32(q[ok]) * x[k0 + k]
                s1 += np.float32(q[ok + R]) * x[k0 + k + 1]
                s2 += np.float32(q[ok + 2 * R]) * x[k0 + k + 2]
                s3 += np.float32(q[ok + 3 * R]) * x[k0 + k + 3]
            if offset:
                acc[r] += a[b * R + r] * ((s0 + s1) + (s2 + s3)) + c[b * R + r] * xsum[b]
            else:
                acc[r] += a[b * R + r] * ((s0 + s1) + (s2 + s3))


@njit(cache=True, inline="always")
def _tile_two(q, a, c, x, u, xsum, usum, acc, acc_u, qk, offset):
    """_tile_one for tokens x and u at once: each weight is loaded and converted once and used
    twice; every operation of either token is the one _tile_one performs."""
    acc[:] = 0
    acc_u[:] = 0
    for b in range(x.shape[0] // qk):
        k0 = b * qk
        for r in range(R):
            o = k0 * R + r
            w0, w1 = np.float32(q[o]), np.float32(q[o + R])
            w2, w3 = np.float32(q[o + 2 * R]), np.float32(q[o + 3 * R])
            s0, s1, s2, s3 = w0 * x[k0], w1 * x[k0 + 1], w2 * x[k0 + 2], w3 * x[k0 + 3]
            v0, v1, v2, v3 = w0 * u[k0], w1 * u[k0 + 1], w2 * u[k0 + 2], w3 * u[k0 + 3]
            for k in range(PHASES, qk, PHASES):
                ok = o + k * R
                w0, w1 = np.float32(q[ok]), np.float32(q[ok + R])
                w2, w3 = np.float32(q[ok + 2 * R]), np.float32(q[ok + 3 * R])
                s0 += w0 * x[k0 + k]
                s1 += w1 * x[k0 + k + 1]
                s2 += w2 * x[k0 + k + 2]
                s3 += w3 * x[k0 + k + 3]
                v0 += w0 * u[k0 + k]
                v1 += w1 * u[k0 + k + 1]
                v2 += w2 * u[k0 + k + 2]
                v3 += w3 * u[k0 + k + 3]
            ab = a[b * R + r]
            if offset:
                cb = c[b * R + r]
                acc[r] += ab * ((s0 + s1) + (s2 + s3)) + cb * xsum[b]
                acc_u[r] += ab * ((v0 + v1) + (v2 + v3)) + cb * usum[b]
            else:
                acc[r] += ab * ((s0 + s1) + (s2 + s3))
                acc_u[r] += ab * ((v0 + v1) + (v2 + v3))


def _kernel(qk: int, offset: bool):
    """The parallel kernel for sub-blocks of qk columns, with or without offsets: x (T, K)
    float32, tiles q, a, c -> out (T, N) float32; threads split the tiles."""

    @njit(parallel=True, cache=True, nogil=True)
    def kernel(x, q, a, c, out):
        T, K = x.shape
        N = out.shape[1]
        xsum = np.empty((T, K // qk if offset else 0), dtype=np.float32)
        if offset:
            _block_sums(x, xsum, qk)
        for i in prange(q.shape[0]):
            # scratch per tile: views of one per-call array (as the int8 kernels have) made
            # this kernel 3-4x slower (session 32: a Gemma 3 float prefill 9.6 s -> 40 s)
            acc = np.empty(R, dtype=np.float32)
            acc_u = np.empty(R, dtype=np.float32)
            n0 = i * R
            lanes = min(R, N - n0)
            for t in range(0, T - 1, 2):
                _tile_two(q[i], a[i], c[i], x[t], x[t + 1], xsum[t], xsum[t + 1], acc, acc_u,
                          qk, offset)
                out[t, n0:n0 + lanes] = acc[:lanes]
                out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
            if T % 2:
                _tile_one(q[i], a[i], c[i], x[T - 1], xsum[T - 1], acc, qk, offset)
                out[T - 1, n0:n0 + lanes] = acc[:lanes]

    return kernel


KERNELS = {(qk, offset): _kernel(qk, offset) for qk in (16, 32) for offset in (False, True)}


def _matmul(kernel, x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T with the numba kernel; inputs already checked."""
    kernel(x, tiles.q, tiles.a, tiles.c, out)


def _matmul_numpy(qk: int, offset: bool, x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """The NumPy twin of the kernels: the same float32 operations in the same order."""
    T, N = out.shape
    xb = phase_view(x, qk)  # (T, n_sub, steps, PHASES)
    xsum = phase_sum(xb[..., None])[..., 0]  # (T, n_sub)
    q = phase_view(tiles.q.reshape(tiles.q.shape[0], -1, R).transpose(0, 2, 1), qk)
    q = q.transpose(0, 2, 3, 4, 1).astype(np.float32)  # (n_tiles, n_sub, steps, PHASES, R)
    a = tiles.a.reshape(tiles.a.shape[0], -1, R)  # (n_tiles, n_sub, R)
    c = tiles.c.reshape(tiles.c.shape[0], -1, R) if offset else None
    acc = np.zeros((T, q.shape[0], R), dtype=np.float32)
    for b in range(q.shape[1]):
        term = a[None, :, b] * phase_sum(q[None, :, b] * xb[:, None, b, :, :, None])
        if offset:
            term = term + c[None, :, b] * xsum[:, b, None, None]
        acc = acc + term
    out[:] = acc.reshape(T, -1)[:, :N]


def codec(qtype: QType, fields: Callable[[np.ndarray], Fields], qk: int,
          offset: Offset) -> Codec:
    """The Codec of a sub-block format from its unpacker: raw (rows, row_bytes) uint8 -> Fields
    with sub-blocks of qk columns, c present unless offset is Offset.NONE."""
    return float_codec(qtype, partial(_dequantize, fields, offset),
                       partial(_repack, fields, offset), qk, offset)


def float_codec(qtype: QType, dequantize: Callable[[np.ndarray], np.ndarray],
                repack: Callable[[np.ndarray], Tiles], qk: int, offset: Offset) -> Codec:
    """The Codec of a format with its own dequantizer and repack (Q8_0, Q4_0 and Q4_1 unpack
    their bytes straight into Tiles, faster at load than going through Fields) and this
    module's row reader, kernel and twin."""
    has_c = offset is not Offset.NONE
    return Codec(qtype, np.dtype(np.uint8), dequantize, repack, partial(_unpack_rows, offset),
                 partial(_matmul, KERNELS[qk, has_c]), partial(_matmul_numpy, qk, has_c))


def no_offsets(a_tiles: np.ndarray) -> np.ndarray:
    """The c of Tiles for a format without offsets: (n_tiles, 0) float32."""
    return np.zeros((a_tiles.shape[0], 0), dtype=np.float32)
