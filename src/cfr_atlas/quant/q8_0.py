"""Q8_0: 8-bit weights with a per-block scale (the bundled model's tied embedding/output matrix).
Dequantization bitwise equal to gguf-py and the load-time repack into subblock.py's row tiles
(whose kernel, twin and row reader are the float path).
INT8 is the integer-path codec (int8.py): block tiles of int8, term_b = (d_b * d_x) * isum_b.

Not here: shape checks (weight.py), the tile layout and reduction order (tiles.py), quantization.
"""

# Q8_0 block, 34 bytes for 32 weights: d f16 | qs 32 x int8, little-endian; w = d * q.

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cfr_atlas.quant import int8, subblock
from cfr_atlas.quant.formats import BLOCKS, Codec, QType
from cfr_atlas.quant.tiles import TILE_ROWS, gather_rows, to_tiles

QK = BLOCKS[QType.Q8_0].elements
BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (QK,))])
assert BLOCK.itemsize == BLOCKS[QType.Q8_0].bytes
R = TILE_ROWS
assert QK == int8.QK and R % int8.GROUP == 0  # a tile's block: R / GROUP integer dots

# Rounding facts. f16 -> f32 is exact (subnormals included), and so is d * q in float32: an
# 11-bit significand times an 8-bit integer needs 19 bits, and the smallest f16 subnormal times
# 1 is still a float32 normal. Dequantization therefore rounds nothing and matches gguf-py's
# `x * d` exactly; the kernels round at each product q * x and each add (see tiles.py). (gguf's
# quantizer rounds half away from zero, unlike NumPy's half-to-even np.round; cfr-atlas never
# quantizes, so only dequantization and kernel rounding matter here.)


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


def repack(raw: np.ndarray) -> subblock.Tiles:
    """raw (N, row_bytes) uint8 -> subblock Tiles: 1 byte per weight plus 4 bytes of scale per
    block, no offsets."""
    d, q = _fields(raw)
    a = to_tiles(d)
    return subblock.Tiles(to_tiles(q), a, subblock.no_offsets(a))


# The float path is subblock.py's kernel, twin and row reader (a sub-block of 32, no offset).
CODEC = subblock.float_codec(QType.Q8_0, dequantize, repack, QK, subblock.Offset.NONE)


# --- the integer path (int8.py): activations quantized per block, int32 block dots ---------


class IntTiles(NamedTuple):
    q: np.ndarray  # (n_tiles, nb * TILE_ROWS * QK) uint8 block tiles of the int8 quants,
    #                sign bit flipped (int8.py: u = q ^ 0x80, what vpdpbusd reads unsigned)
    d: np.ndarray  # (n_tiles, nb * TILE_ROWS) float16 block scales, their bits (tiles.py layout)


def int_repack(raw: np.ndarray) -> IntTiles:
    """raw (N, row_bytes) uint8 -> IntTiles: 1 byte per weight (its sign bit flipped) plus the
    block's float16 scale as GGUF stores it (8.5 bits a weight)."""
    _, q = _fields(raw)
    d = np.ascontiguousarray(raw).view(BLOCK)["d"].view(np.uint16)
    return IntTiles(int8.to_block_tiles(int8.flip_sign(q), QK), to_tiles(d))


def int_unpack_rows(tiles: IntTiles, ids: np.ndarray | slice,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the dequantized matrix: (len(ids), K) float32 == dequantize(raw)[ids]."""
    q = int8.flip_sign(int8.gather_block_rows(tiles.q, ids, QK)).view(np.int8)
    d = int8.widen_scales(gather_rows(tiles.d, ids))
    return values(d, q, np.empty(q.shape, dtype=np.float32) if out is None else out)


_int_kernel = int8.tile_kernel(bits=8, term=int8.SCALE)


def int_matmul(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T on the integer path; inputs already checked."""
    xq, xd, xsum = int8.quantize_transient(x)
    _int_kernel(xq, xd, xsum, tiles.q, tiles.d, tiles.d, out)


def int_matmul_numpy(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """The NumPy twin of `int_matmul`: the same quantization, exact block dots, the same float32
    operations in the same block order."""
    xq, xd, _ = int8.quantize_numpy(x)
    w = int8.flip_sign(int8.gather_block_rows(tiles.q, slice(None), QK)).view(np.int8)
    dots = int8.block_dots_numpy(w, xq)
    dots = dots.astype(np.float32)  # exact: |isum| <= 32 * 128 * 127 < 2**24
    d = int8.widen_scales(gather_rows(tiles.d, slice(None)))  # (N padded, nb)
    with np.errstate(over="ignore", invalid="ignore"):  # edge scales: inf, as the kernel
        acc = np.zeros(dots.shape[:2], dtype=np.float32)
        for b in range(d.shape[1]):
            acc = acc + (d[None, :, b] * xd[:, None, b]) * dots[:, :, b]
    out[:] = acc[:, :out.shape[1]]


INT8 = Codec(QType.Q8_0, np.dtype(np.uint8), dequantize, int_repack, int_unpack_rows, int_matmul,
             int_matmul_numpy)
