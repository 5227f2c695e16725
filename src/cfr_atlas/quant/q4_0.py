"""Q4_0: 4-bit weights with a per-block scale. Dequantization bitwise equal to gguf-py and a
load-time repack that unpacks the nibbles to int8 (q - 8), which makes a Q4_0 matrix a Q8_0 one
with small integers: kernel, twin and row reader are subblock.py's, as for Q8_0. INT8 is the
integer-path codec (int8.py): nibbles kept packed in block tiles, term_b = (d_b * d_x) *
(isum_b - 8 * xsum_b), isum_b the dot of the stored nibbles 0..15 (the - 8 applied once per
block, in integers).

Not here: a float kernel of its own (subblock.py's is exact for it), shape checks, quantization.
"""

# Q4_0 block, 18 bytes for 32 weights: d f16 | qs 16 x u8, little-endian;
# qs[j] holds q[j] in its low nibble and q[j + 16] in its high nibble; w = d * (q - 8).

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from cfr_atlas.quant import int8, q8_0, subblock
from cfr_atlas.quant.formats import BLOCKS, Codec, QType
from cfr_atlas.quant.tiles import TILE_ROWS, gather_rows, nibble_tiles, to_tiles

QK = BLOCKS[QType.Q4_0].elements
BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
assert BLOCK.itemsize == BLOCKS[QType.Q4_0].bytes
assert QK == q8_0.QK  # the tiles share q8_0's block of scales
OFFSET = np.int8(8)  # stored nibbles are q + 8
R = TILE_ROWS
HALF = QK // 2  # packed bytes per block

# Rounding facts: as for Q8_0, d * (q - 8) is exact in float32, so dequantization rounds nothing.


def _fields(raw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """raw (rows, row_bytes) uint8 -> d (rows, nb) float32 and q - 8 (rows, nb * QK) int8."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)  # (rows, nb)
    qs = blocks["qs"]
    q = np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1).view(np.int8)
    return blocks["d"].astype(np.float32), (q - OFFSET).reshape(q.shape[0], -1)


def dequantize(raw: np.ndarray) -> np.ndarray:
    """raw (rows, row_bytes) uint8 -> (rows, cols) float32, bitwise equal to gguf-py."""
    d, q = _fields(raw)
    return q8_0.values(d, q, np.empty(q.shape, dtype=np.float32))


def repack(raw: np.ndarray) -> subblock.Tiles:
    """raw (N, row_bytes) uint8 -> subblock Tiles of q - 8: 1 byte per weight plus the scales."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)
    a = to_tiles(blocks["d"].astype(np.float32))
    return subblock.Tiles(nibble_tiles(blocks["qs"], int(OFFSET), np.int8), a,
                          subblock.no_offsets(a))


CODEC = subblock.float_codec(QType.Q4_0, dequantize, repack, QK, subblock.Offset.NONE)


# --- the integer path (int8.py): activations quantized per block, int32 block dots ---------


class IntTiles(NamedTuple):
    q: np.ndarray  # (n_tiles, nb * TILE_ROWS * 16) uint8 block tiles of GGUF's packed nibbles
    d: np.ndarray  # (n_tiles, nb * TILE_ROWS) float16 block scales as GGUF stores them (bits)


def int_repack(raw: np.ndarray) -> IntTiles:
    """raw (N, row_bytes) uint8 -> IntTiles: half a byte per weight plus 2 bytes per block
    (GGUF's 4.5 bits a weight)."""
    blocks = np.ascontiguousarray(raw).view(BLOCK)
    qs = blocks["qs"]
    return IntTiles(int8.to_block_tiles(qs.reshape(qs.shape[0], -1), HALF),
                    to_tiles(blocks["d"].view(np.uint16)))


def int_unpack_rows(tiles: IntTiles, ids: np.ndarray | slice,
                    out: np.ndarray | None = None) -> np.ndarray:
    """Rows `ids` of the dequantized matrix: (len(ids), K) float32 == dequantize(raw)[ids]."""
    q = int8.gather_nibble_rows(tiles.q, ids).view(np.int8) - OFFSET
    d = int8.widen_scales(gather_rows(tiles.d, ids))
    return q8_0.values(d, q, np.empty(q.shape, dtype=np.float32) if out is None else out)


_int_kernel = int8.tile_kernel(bits=4, term=int8.OFFSET8)


def int_matmul(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """out (T, N) = x (T, K) @ W.T on the integer path; inputs already checked."""
    xq, xd, xsum = int8.quantize_transient(x)
    _int_kernel(xq, xd, xsum, tiles.q, tiles.d, tiles.d, out)


def int_matmul_numpy(x: np.ndarray, tiles: IntTiles, out: np.ndarray) -> None:
    """The NumPy twin of `int_matmul`: the same quantization, exact block dots, the same float32
    operations in the same block order."""
    xq, xd, xsum = int8.quantize_numpy(x)
    w = int8.gather_nibble_rows(tiles.q, slice(None))
    dots = int8.block_dots_numpy(w, xq) - 8 * xsum[:, None, :]  # (T, N padded, nb) exact
    dots = dots.astype(np.float32)  # exact: |isum - 8 xsum| < 2**24
    d = int8.widen_scales(gather_rows(tiles.d, slice(None)))
    with np.errstate(over="ignore", invalid="ignore"):  # edge scales: inf, as the kernel
        acc = np.zeros(dots.shape[:2], dtype=np.float32)
        for b in range(d.shape[1]):
            acc = acc + (d[None, :, b] * xd[:, None, b]) * dots[:, :, b]
    out[:] = acc[:, :out.shape[1]]


INT8 = Codec(QType.Q4_0, np.dtype(np.uint8), dequantize, int_repack, int_unpack_rows, int_matmul,
             int_matmul_numpy)
