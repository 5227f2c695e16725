"""Q4_1: 4-bit weights with a per-block scale and minimum (every matrix of the bundled model but
the embedding). Dequantization bitwise equal to gguf-py, the load-time repack into row tiles, the
numba matmul kernel and its NumPy twin. INT8 is the integer-path codec (int8.py): nibbles kept
packed in block tiles, term_b = (d_b * d_x) * isum_b + m_b * (d_x * xsum_b).

Not here: shape checks (weight.py does them; kernels trust their inputs), the tile layout and
reduction order (tiles.py), and quantization (tests use gguf.quants.quantize).
"""

# Q4_1 block, 20 bytes for 32 weights: d f16 | m f16 | qs 16 x u8, little-endian;
# qs[j] holds q[j] in its low nibble and q[j + 16] in its high nibble; w = d * q + m, q in 0..15.

from __future__ import annotations

from typing import NamedTuple

import numpy as np
from numba import njit, prange

from cfr_atlas.quant import int8
from cfr_atlas.quant.formats import BLOCKS, Codec, QType
from cfr_atlas.quant.tiles import (
    PHASES,
    TILE_ROWS,
    gather_rows,
    nibble_tiles,
    phase_sum,
    phase_view,
    to_tiles,
)

QK = BLOCKS[QType.Q4_1].elements
BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (QK // 2,))])
assert BLOCK.itemsize == BLOCKS[QType.Q4_1].bytes
R = TILE_ROWS
assert QK == int8.QK and R == 2 * int8.GROUP  # a tile's block is two 8-row integer dots
HALF = QK // 2  # packed bytes per block

# Rounding facts. f16 -> f32 is exact (subnormals included). d * q is exact in float32 (11-bit
# significand times a 4-bit integer), so `(d * q) + m` rounds once, at the add, to nearest-even;
# gguf-py computes the same two NumPy operations. A fused multiply-add would differ in the last
# bit, which is why neither the dequantizer nor the kernels may use one.


class Tiles(NamedTuple):
    q: np.ndarray  # (n_tiles, K * TILE_ROWS) uint8, nibbles unpacked to 0..15
    d: np.ndarray  # (n_tiles, K // QK * TILE_ROWS) float32 block scales
    m: np.ndarray  # (n_tiles, K // QK * TILE_ROWS) float32 block minimums


def _fields(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """raw (rows, row_bytes) uint8 -> d, m (rows, nb) float32 and q (rows, nb * QK) uint8."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)  # (rows, nb)
    qs = blocks["qs"]
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)
    d = blocks["d"].astype(np.float32)
    m = blocks["m"].astype(np.float32)
    return d, m, q.reshape(q.shape[0], -1)


def _values(d: np.ndarray, m: np.ndarray, q: np.ndarray, out: np.ndarray) -> np.ndarray:
    """d, m (n, nb), q (n, nb * QK) -> out (n, nb * QK) = (d * q) + m; only the add rounds."""
    n, nb = d.shape
    out3 = out.reshape(n, nb, QK)
    np.multiply(d[:, :, None], q.reshape(n, nb, QK), out=out3, dtype=np.float32)
    np.add(out3, m[:, :, None], out=out3)
    return out


def dequantize(raw: np.ndarray) -> np.ndarray:
    """raw (rows, row_bytes) uint8 -> (rows, cols) float32, bitwise equal to gguf-py."""
    d, m, q = _fields(raw)
    return _values(d, m, q, np.empty(q.shape, dtype=np.float32))


def repack(raw: np.ndarray) -> Tiles:
    """raw (N, row_bytes) uint8 -> Tiles: 1 byte per weight plus 8 bytes of scales per block."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)
    d, m = blocks["d"].astype(np.float32), blocks["m"].astype(np.float32)
    return Tiles(nibble_tiles(blocks["qs"]), to_tiles(d), to_tiles(m))


def unpack_rows(tiles: Tiles, ids: np.ndarray | slice,
                out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the dequantized matrix: (len(ids), K) float32 == dequantize(raw)[ids]."""
    q, d, m = (gather_rows(a, ids) for a in tiles)
    out = np.empty(q.shape, dtype=np.float32) if out is None else out
    return _values(d, m, q, out)


@njit(cache=True)
def _block_sums(x, xsum):
    """x (T, K) -> xsum (T, K // QK): each block's sum in the phase order of tiles.py."""
    T, K = x.shape
    for t in range(T):
        for b in range(K // QK):
            k0 = b * QK
            p0, p1, p2, p3 = x[t, k0], x[t, k0 + 1], x[t, k0 + 2], x[t, k0 + 3]
            for k in range(k0 + PHASES, k0 + QK, PHASES):
                p0 += x[t, k]
                p1 += x[t, k + 1]
                p2 += x[t, k + 2]
                p3 += x[t, k + 3]
            xsum[t, b] = (p0 + p1) + (p2 + p3)


@njit(cache=True, inline="always")
def _tile_one(q, d, m, x, xsum, acc):
    """acc (R,) = one tile (q (K * R,), d, m (nb * R,)) times one token x (K,), xsum (nb,)."""
    acc[:] = 0
    for b in range(xsum.shape[0]):
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
            acc[r] += d[b * R + r] * ((s0 + s1) + (s2 + s3)) + m[b * R + r] * xsum[b]


@njit(cache=True, inline="always")
def _tile_two(q, d, m, x, u, xsum, usum, acc, acc_u):
    """_tile_one for tokens x and u at once: each weight is loaded and converted once and used
    twice; every operation of either token is the one _tile_one performs."""
    acc[:] = 0
    acc_u[:] = 0
    for b in range(xsum.shape[0]):
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
            db, mb = d[b * R + r], m[b * R + r]
            acc[r] += db * ((s0 + s1) + (s2 + s3)) + mb * xsum[b]
            acc_u[r] += db * ((v0 + v1) + (v2 + v3)) + mb * usum[b]


@njit(parallel=True, cache=True)
def _kernel(x, q, d, m, out):
    """x (T, K) float32, tiles q, d, m -> out (T, N) float32; threads split the tiles."""
    T, K = x.shape
    N = out.shape[1]
    xsum = np.empty((T, K // QK), dtype=np.float32)
    _block_sums(x, xsum)
    for i in prange(q.shape[0]):
        acc = np.empty(R, dtype=np.float32)
        acc_u = np.empty(R, dtype=np.float32)
        n0 = i * R
        lanes = min(R, N - n0)
        for t in range(0, T - 1, 2):
            _tile_two(q[i], d[i], m[i], x[t], x[t + 1], xsum[t], xsum[t + 1], acc, acc_u)
            out[t, n0:n0 + lanes] = acc[:lanes]
            out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
        if T % 2:
            _tile_one(q[i], d[i], m[i], x[T - 1], xsum[T - 1], acc)
            out[T - 1, n0:n0 + lanes] = acc[:lanes]


def matmul(x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T with the numba kernel; inputs already checked."""
    _kernel(x, tiles.q, tiles.d, tiles.m, out)


def matmul_numpy(x: np.ndarray, tiles: Tiles, out: np.ndarray) -> None:
    """The NumPy twin of `matmul`: the same float32 operations in the same order, vectorized."""
    T, N = out.shape
    xb = phase_view(x, QK)  # (T, nb, steps, PHASES)
    xsum = phase_sum(xb[..., None])[..., 0]  # (T, nb)
    q = phase_view(tiles.q.reshape(tiles.q.shape[0], -1, R).transpose(0, 2, 1), QK)
    q = q.transpose(0, 2, 3, 4, 1).astype(np.float32)  # (n_tiles, nb, steps, PHASES, R)
    d = tiles.d.reshape(tiles.d.shape[0], -1, R)  # (n_tiles, nb, R)
    m = tiles.m.reshape(tiles.m.shape[0], -1, R)
    acc = np.zeros((T, q.shape[0], R), dtype=np.float32)
    for b in range(q.shape[1]):
        s = phase_sum(q[None, :, b] * xb[:, None, b, :, :, None])  # (T, n_tiles, R)
        acc = acc + (d[None, :, b] * s + m[None, :, b] * xsum[:, b, None, None])
    out[:] = acc.reshape(T, -1)[:, :N]


CODEC = Codec(QType.Q4_1, np.dtype(np.uint8), dequantize, repack, unpack_rows, matmul,
              matmul_numpy)


# --- the integer path (int8.py): activations quantized per block, int32 block dots ---------


class IntTiles(NamedTuple):
    q: np.ndarray  # (n_tiles, nb * TILE_ROWS * 16) uint8 block tiles of GGUF's packed nibbles
    d: np.ndarray  # (n_tiles, nb * TILE_ROWS) float32 block scales, as in Tiles
    m: np.ndarray  # (n_tiles, nb * TILE_ROWS) float32 block minimums


def int_repack(raw: np.ndarray) -> IntTiles:
    """raw (N, row_bytes) uint8 -> IntTiles: half a byte per weight plus 8 bytes per block."""
    d, m, _ = _fields(raw)
    qs = np.ascontiguousarray(raw).view(BLOCK)["qs"]
    return IntTiles(int8.to_block_tiles(qs.reshape(qs.shape[0], -1), HALF), to_tiles(d),
                    to_tiles(m))


def int_unpack_rows(tiles: IntTiles, ids: np.ndarray | slice,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the dequantized matrix: (len(ids), K) float32 == dequantize(raw)[ids]."""
    q = int8.unpack_nibbles(int8.gather_block_rows(tiles.q, ids, HALF))
    d, m = gather_rows(tiles.d, ids), gather_rows(tiles.m, ids)
    return _values(d, m, q, np.empty(q.shape, dtype=np.float32) if out is None else out)


@njit(cache=True, inline="always")
def _int_add(acc, d, m, b, xd, sx, isum):
    """acc (R,) += block b's terms: (d_b * d_x) * isum_b + m_b * sx per row, sx = d_x xsum_b."""
    for r in range(R):
        k = b * R + r
        acc[r] += (d[k] * xd) * np.float32(isum[r]) + m[k] * sx


@njit(parallel=True, cache=True)
def _int_kernel(xq, xd, xsum, q, d, m, out):
    """xq (T, K) int8, xd, xsum (T, nb), block tiles q, d, m -> out (T, N); tokens in pairs."""
    T, K = xq.shape
    N, G = out.shape[1], int8.GROUP
    sx = xd * xsum.astype(np.float32)  # (T, nb): llama.cpp's q8_1 s = d * sum(q)
    for i in prange(q.shape[0]):
        acc, acc_u = np.empty(R, dtype=np.float32), np.empty(R, dtype=np.float32)
        isum, isum_u = np.empty(R, dtype=np.int32), np.empty(R, dtype=np.int32)
        n0 = i * R
        lanes = min(R, N - n0)
        for t in range(0, T - 1, 2):
            acc[:] = 0
            acc_u[:] = 0
            for b in range(K // QK):
                o, k0 = b * R * HALF, b * QK
                int8.dot8x2_nibbles(q[i], o, xq[t], k0, isum, 0, xq[t + 1], k0, isum_u)
                int8.dot8x2_nibbles(q[i], o + G * HALF, xq[t], k0, isum, G, xq[t + 1], k0,
                                    isum_u)
                _int_add(acc, d[i], m[i], b, xd[t, b], sx[t, b], isum)
                _int_add(acc_u, d[i], m[i], b, xd[t + 1, b], sx[t + 1, b], isum_u)
            out[t, n0:n0 + lanes] = acc[:lanes]
            out[t + 1, n0:n0 + lanes] = acc_u[:lanes]
        if T % 2:
            t = T - 1
            acc[:] = 0
            for b in range(K // QK):
                o, k0 = b * R * HALF, b * QK
                int8.dot8_nibbles(q[i], o, xq[t], k0, isum, 0)
                int8.dot8_nibbles(q[i], o + G * HALF, xq[t], k0, isum, G)
                _int_add(acc, d[i], m[i], b, xd[t, b], sx[t, b], isum)
            out[t, n0:n0 + lanes] = acc[:lanes]


def int_matmul(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T on the integer path; inputs already checked."""
    xq, xd, xsum = int8.quantize(x)
    _int_kernel(xq, xd, xsum, tiles.q, tiles.d, tiles.m, out)


def int_matmul_numpy(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """The NumPy twin of `int_matmul`: the same quantization, exact block dots, the same float32
    operations in the same block order."""
    xq, xd, xsum = int8.quantize_numpy(x)
    w = int8.unpack_nibbles(int8.gather_block_rows(tiles.q, slice(None), HALF))
    dots = int8.block_dots_numpy(w, xq).astype(np.float32)  # exact: |isum| < 2**24
    sx = xd * xsum.astype(np.float32)  # (T, nb)
    d, m = gather_rows(tiles.d, slice(None)), gather_rows(tiles.m, slice(None))
    with np.errstate(over="ignore", invalid="ignore"):  # edge scales: inf, as the kernel
        acc = np.zeros(dots.shape[:2], dtype=np.float32)
        for b in range(d.shape[1]):
            term = (d[None, :, b] * xd[:, None, b]) * dots[:, :, b] + m[None, :, b] * sx[:, None, b]
            acc = acc + term
    out[:] = acc[:, :out.shape[1]]


INT8 = Codec(QType.Q4_1, np.dtype(np.uint8), dequantize, int_repack, int_unpack_rows, int_matmul,
             int_matmul_numpy)
