"""Q8_0: 8-bit weights with a per-block scale (the bundled model's tied embedding/output matrix).
Dequantization bitwise equal to gguf-py, the load-time repack into row tiles, the numba matmul
kernel and its NumPy twin. Q4_0 repacks into the same tiles and reuses this kernel (q4_0.py).
INT8 is the integer-path codec (int8.py): block tiles of int8, term_b = (d_b * d_x) * isum_b.

Not here: shape checks (weight.py), the tile layout and reduction order (tiles.py), quantization.
"""

# Q8_0 block, 34 bytes for 32 weights: d f16 | qs 32 x int8, little-endian; w = d * q.

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from cfr_atlas.quant import int8
from cfr_atlas.quant.formats import BLOCKS, Codec, QType
from cfr_atlas.quant.tiles import PHASES, TILE_ROWS, gather_rows, phase_sum, phase_view, to_tiles

QK = BLOCKS[QType.Q8_0].elements
BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])
assert BLOCK.itemsize == BLOCKS[QType.Q8_0].bytes
R = TILE_ROWS
assert QK == int8.QK and R == 2 * int8.GROUP  # a tile's block is two 8-row integer dots

# Rounding facts. f16 -> f32 is exact (subnormals included), and so is d * q in float32: an
# 11-bit significand times an 8-bit integer needs 19 bits, and the smallest f16 subnormal times
# 1 is still a float32 normal. Dequantization therefore rounds nothing and matches gguf-py's
# `x * d` exactly; the kernels round at each product q * x and each add (see tiles.py). (gguf's
# quantizer rounds half away from zero, unlike NumPy's half-to-even np.round; cfr-atlas never
# quantizes, so only dequantization and kernel rounding matter here.)


class Tiles(NamedTuple):
    q: np.ndarray  # (n_tiles, K * TILE_ROWS) int8
    d: np.ndarray  # (n_tiles, K // QK * TILE_ROWS) float32 block scales


def _fields(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """raw (rows, row_bytes) uint8 -> d (rows, nb) float32 and q (rows, nb * QK) int8."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)  # (rows, nb)
    q = blocks["qs"]
    return blocks["d"].astype(np.float32), q.reshape(q.shape[0], -1)


def values(d: np.ndarray, q: np.ndarray, out: np.ndarray) -> np.ndarray:
    """d (n, nb), q (n, nb * QK) integers -> out (n, nb * QK) float32 = d * q (exact)."""
    n, nb = d.shape
    np.multiply(q.reshape(n, nb, QK), d[:, :, None], out=out.reshape(n, nb, QK),
                dtype=np.float32)
    return out


def dequantize(raw: np.ndarray) -> np.ndarray:
    """raw (rows, row_bytes) uint8 -> (rows, cols) float32, bitwise equal to gguf-py."""
    d, q = _fields(raw)
    return values(d, q, np.empty(q.shape, dtype=np.float32))


def repack(raw: np.ndarray) -> Tiles:
    """raw (N, row_bytes) uint8 -> Tiles: 1 byte per weight plus 4 bytes of scale per block."""
    d, q = _fields(raw)
    return Tiles(to_tiles(q), to_tiles(d))


def unpack_rows(tiles: Tiles, ids: np.ndarray | slice,
                out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the dequantized matrix: (len(ids), K) float32 == dequantize(raw)[ids]."""
    q, d = gather_rows(tiles.q, ids), gather_rows(tiles.d, ids)
    return values(d, q, np.empty(q.shape, dtype=np.float32) if out is None else out)


@njit(cache=True, inline="always")
def _tile_one(q, d, x, acc):
    """acc (R,) = one tile (q (K * R,), d (nb * R,)) times one token x (K,)."""
    acc[:] = 0
    for b in range(x.shape[0] // QK):
        k0 = b * QK
        for r in range(R):  # vectorized across the tile's rows; each row a scalar chain
            o = k0 * R + r
            s0 = np.float32(q[o]) * x[k0]
            s1 = np.float32(q[o + R]) * x[k0 + 1]
            s2 = np.float32(q[o + 2 * R]) * x[k0 + 2]
            s3 = np.float32(q[o + 3 * R]) * x[k0 + 3]
            for k in range(PHASES, QK, PHASES):
                ok = o + k * R
                s0 += np.float32(q[ok]) * x[k0 + k]
                s1 += np.float32(q[ok + R]) * x[k0 + k + 1]
                s2 += np.float32(q[ok + 2 * R]) * x[k0 + k + 2]
                s3 += np.float32(q[ok + 3 * R]) * x[k0 + k + 3]
            acc[r] += d[b * R + r] * ((s0 + s1) + (s2 + s3))


@njit(cache=True, inline="always")
def _tile_two(q, d, x, u, acc, acc_u):
    """_tile_one for tokens x and u at once: each weight is loaded and converted once and used
    twice; every operation of either token is the one _tile_one performs."""
    acc[:] = 0
    acc_u[:] = 0
    for b in range(x.shape[0] // QK):
        k0 = b * QK
        for r in range(R):
            o = k0 * R + r
            w0, w1 = np.float32(q[o]), np.float32(q[o + R])
            w2, w3 = np.float32(q[o + 2 * R]), np.float32(q[o + 3 * R])
            s0, s1, s2, s3 = w0 * x[k0], w1 * x[k0 + 1], w2 * x[k0 + 2], w3 * x[k0 + 3]
            v0, v1, v2, v3 = w0 * u[k0], w1 * u[k0 + 1], w2 * u[k0 + 2], w3 * u[k0 + 3]
            for k in range(PHASES, QK, PHASES):
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
            db = d[b * R + r]
            acc[r] += db * ((s0 + s1) + (s2 + s3))
            acc_u[r] += db * ((v0 + v1) + (v2 + v3))


@njit(parallel=True, cache=True)
def _kernel(x, q, d, out):
    """x (T, K) float32, tiles q, d -> out (T, N) float32; threads split the tiles."""
    T = x.shape[0]
    N = out.shape[1]
    for i in prange(q.shape[0]):
        acc = np.empty(R, dtype=np.float32)
        acc_u = np.empty(R, dtype=np.float32)
        n0 = i * R
        lanes = min(R, N - n0)
        for t in range(0, T - 1, 2):
            _tile_two(q[i], d[i], x[t], x[t + 1], acc, acc_u)
            out[t, n0:n0 + lanes] = acc[:lanes]
            out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
        if T % 2:
            _tile_one(q[i], d[i], x[T - 1], acc)
            out[T - 1, n0:n0 + lanes] = acc[:lanes]


def matmul(x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T with the numba kernel; inputs already checked."""
    _kernel(x, tiles.q, tiles.d, out)


def matmul_numpy(x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """The NumPy twin of `matmul`: the same float32 operations in the same order, vectorized."""
    T, N = out.shape
    xb = phase_view(x, QK)  # (T, nb, steps, PHASES)
    q = phase_view(tiles.q.reshape(tiles.q.shape[0], -1, R).transpose(0, 2, 1), QK)
    q = q.transpose(0, 2, 3, 4, 1).astype(np.float32)  # (n_tiles, nb, steps, PHASES, R)
    d = tiles.d.reshape(tiles.d.shape[0], -1, R)  # (n_tiles, nb, R)
    acc = np.zeros((T, q.shape[0], R), dtype=np.float32)
    for b in range(q.shape[1]):
        acc = acc + d[None, :, b] * phase_sum(q[None, :, b] * xb[:, None, b, :, :, None])
    out[:] = acc.reshape(T, -1)[:, :N]


CODEC = Codec(QType.Q8_0, np.dtype(np.uint8), dequantize, repack, unpack_rows, matmul,
              matmul_numpy)


# --- the integer path (int8.py): activations quantized per block, int32 block dots ---------


class IntTiles(NamedTuple):
    q: np.ndarray  # (n_tiles, nb * TILE_ROWS * QK) int8 block tiles (int8.py)
    d: np.ndarray  # (n_tiles, nb * TILE_ROWS) float32 block scales, as in Tiles


def int_repack(raw: np.ndarray) -> IntTiles:
    """raw (N, row_bytes) uint8 -> IntTiles: 1 byte per weight plus 4 bytes of scale per block."""
    d, q = _fields(raw)
    return IntTiles(int8.to_block_tiles(q, QK), to_tiles(d))


def int_unpack_rows(tiles: IntTiles, ids: np.ndarray | slice,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the dequantized matrix: (len(ids), K) float32 == dequantize(raw)[ids]."""
    q, d = int8.gather_block_rows(tiles.q, ids, QK), gather_rows(tiles.d, ids)
    return values(d, q, np.empty(q.shape, dtype=np.float32) if out is None else out)


@njit(cache=True, inline="always")
def _int_add(acc, d, b, xd, isum):
    """acc (R,) += block b's terms: (d_b * d_x) * isum_b per row."""
    for r in range(R):
        acc[r] += (d[b * R + r] * xd) * np.float32(isum[r])


@njit(parallel=True, cache=True)
def _int_kernel(xq, xd, q, d, out):
    """xq (T, K) int8, xd (T, nb), block tiles q, d -> out (T, N); threads split the tiles,
    tokens go in pairs (one weight load for two tokens; every operation per token the same)."""
    T, K = xq.shape
    N, G = out.shape[1], int8.GROUP
    for i in prange(q.shape[0]):
        acc, acc_u = np.empty(R, dtype=np.float32), np.empty(R, dtype=np.float32)
        isum, isum_u = np.empty(R, dtype=np.int32), np.empty(R, dtype=np.int32)
        n0 = i * R
        lanes = min(R, N - n0)
        for t in range(0, T - 1, 2):
            acc[:] = 0
            acc_u[:] = 0
            for b in range(K // QK):
                o, k0 = b * R * QK, b * QK
                int8.dot8x2_int8(q[i], o, xq[t], k0, isum, 0, xq[t + 1], k0, isum_u)
                int8.dot8x2_int8(q[i], o + G * QK, xq[t], k0, isum, G, xq[t + 1], k0, isum_u)
                _int_add(acc, d[i], b, xd[t, b], isum)
                _int_add(acc_u, d[i], b, xd[t + 1, b], isum_u)
            out[t, n0:n0 + lanes] = acc[:lanes]
            out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
        if T % 2:
            t = T - 1
            acc[:] = 0
            for b in range(K // QK):
                o, k0 = b * R * QK, b * QK
                int8.dot8_int8(q[i], o, xq[t], k0, isum, 0)
                int8.dot8_int8(q[i], o + G * QK, xq[t], k0, isum, G)
                _int_add(acc, d[i], b, xd[t, b], isum)
            out[t, n0:n0 + lanes] = acc[:lanes]


def int_matmul(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T on the integer path; inputs already checked."""
    xq, xd, _ = int8.quantize(x)
    _int_kernel(xq, xd, tiles.q, tiles.d, out)


def int_matmul_numpy(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """The NumPy twin of `int_matmul`: the same quantization, exact block dots, the same float32
    operations in the same block order."""
    xq, xd, _ = int8.quantize_numpy(x)
    dots = int8.block_dots_numpy(int8.gather_block_rows(tiles.q, slice(None), QK), xq)
    dots = dots.astype(np.float32)  # exact: |isum| <= 32 * 128 * 127 < 2**24
    d = gather_rows(tiles.d, slice(None))  # (N padded, nb)
    with np.errstate(over="ignore", invalid="ignore"):  # edge scales: inf, as the kernel
        acc = np.zeros(dots.shape[:2], dtype=np.float32)
        for b in range(d.shape[1]):
            acc = acc + (d[None, :, b] * xd[:, None, b]) * dots[:, :, b]
    out[:] = acc[:, :out.shape[1]]


INT8 = Codec(QType.Q8_0, np.dtype(np.uint8), dequantize, int_repack, int_unpack_rows, int_matmul,
             int_matmul_numpy)
