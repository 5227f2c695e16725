"""Q4_1: 4-bit weights with a per-block scale and minimum (every matrix of the bundled model but
the embedding). Dequantization bitwise equal to gguf-py and the load-time repack into
subblock.py's row tiles (whose kernel, twin and row reader are the float path). INT8 is the
integer-path codec (int8.py): nibbles kept packed in block tiles,
term_b = (d_b * d_x) * isum_b + m_b * (d_x * xsum_b).

Not here: shape checks (weight.py does them; kernels trust their inputs), the tile layout and
reduction order (tiles.py), and quantization (tests use gguf.quants.quantize).
"""

# Q4_1 block, 20 bytes for 32 weights: d f16 | m f16 | qs 16 x u8, little-endian;
# qs[j] holds q[j] in its low nibble and q[j + 16] in its high nibble; w = d * q + m, q in 0..15.

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cfr_atlas.quant import int8, subblock
from cfr_atlas.quant.formats import BLOCKS, Codec, QType
from cfr_atlas.quant.tiles import (
    TILE_ROWS,
    gather_rows,
    nibble_tiles,
    to_tiles,
)

QK = BLOCKS[QType.Q4_1].elements
BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qs", "u1", (QK // 2,))])
assert BLOCK.itemsize == BLOCKS[QType.Q4_1].bytes
R = TILE_ROWS
assert QK == int8.QK and R % int8.GROUP == 0  # a tile's block: R / GROUP integer dots
HALF = QK // 2  # packed bytes per block

# Rounding facts. f16 -> f32 is exact (subnormals included). d * q is exact in float32 (11-bit
# significand times a 4-bit integer), so `(d * q) + m` rounds once, at the add, to nearest-even;
# gguf-py computes the same two NumPy operations. A fused multiply-add would differ in the last
# bit, which is why neither the dequantizer nor the kernels may use one.


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


def repack(raw: np.ndarray) -> subblock.Tiles:
    """raw (N, row_bytes) uint8 -> subblock Tiles: q 0..15 as int8 (1 byte per weight), d as
    the scales a and m as the added offsets c (8 bytes per block)."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)
    d, m = blocks["d"].astype(np.float32), blocks["m"].astype(np.float32)
    return subblock.Tiles(nibble_tiles(blocks["qs"], 0, np.int8), to_tiles(d), to_tiles(m))


# The float path is subblock.py's kernel, twin and row reader (a sub-block of 32, offset added):
# term_b = d_b * S_b + m_b * X_b.
CODEC = subblock.float_codec(QType.Q4_1, dequantize, repack, QK, subblock.Offset.ADD)


# --- the integer path (int8.py): activations quantized per block, int32 block dots ---------


class IntTiles(NamedTuple):
    q: np.ndarray  # (n_tiles, nb * TILE_ROWS * 16) uint8 block tiles of GGUF's packed nibbles
    d: np.ndarray  # (n_tiles, nb * TILE_ROWS) float16 block scales, their bits (uint16)
    m: np.ndarray  # (n_tiles, nb * TILE_ROWS) float16 block minimums, their bits (uint16)


def int_repack(raw: np.ndarray) -> IntTiles:
    """raw (N, row_bytes) uint8 -> IntTiles: half a byte per weight plus the block's float16
    d and m as GGUF stores them (5 bits a weight)."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)
    qs = blocks["qs"]
    return IntTiles(int8.to_block_tiles(qs.reshape(qs.shape[0], -1), HALF),
                    to_tiles(blocks["d"].view(np.uint16)),
                    to_tiles(blocks["m"].view(np.uint16)))


def int_unpack_rows(tiles: IntTiles, ids: np.ndarray | slice,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the dequantized matrix: (len(ids), K) float32 == dequantize(raw)[ids]."""
    q = int8.gather_nibble_rows(tiles.q, ids)
    d, m = (int8.widen_scales(gather_rows(a, ids)) for a in (tiles.d, tiles.m))
    return _values(d, m, q, np.empty(q.shape, dtype=np.float32) if out is None else out)


_int_kernel = int8.tile_kernel(bits=4, term=int8.MIN)


def int_matmul(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T on the integer path; inputs already checked."""
    xq, xd, xsum = int8.quantize_transient(x)
    _int_kernel(xq, xd, xsum, tiles.q, tiles.d, tiles.m, out)


def int_matmul_numpy(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """The NumPy twin of `int_matmul`: the same quantization, exact block dots, the same float32
    operations in the same block order."""
    xq, xd, xsum = int8.quantize_numpy(x)
    w = int8.gather_nibble_rows(tiles.q, slice(None))
    dots = int8.block_dots_numpy(w, xq).astype(np.float32)  # exact: |isum| < 2**24
    sx = xd * xsum.astype(np.float32)  # (T, nb)
    d, m = (int8.widen_scales(gather_rows(a, slice(None))) for a in (tiles.d, tiles.m))
    with np.errstate(over="ignore", invalid="ignore"):  # edge scales: inf, as the kernel
        acc = np.zeros(dots.shape[:2], dtype=np.float32)
        for b in range(d.shape[1]):
            term = (d[None, :, b] * xd[:, None, b]) * dots[:, :, b] + m[None, :, b] * sx[:, None, b]
            acc = acc + term
    out[:] = acc[:, :out.shape[1]]


INT8 = Codec(QType.Q4_1, np.dtype(np.uint8), dequantize, int_repack, int_unpack_rows, int_matmul,
             int_matmul_numpy)
