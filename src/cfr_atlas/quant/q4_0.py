"""Q4_0: 4-bit weights with a per-block scale. Dequantization bitwise equal to gguf-py and a
load-time repack that unpacks the nibbles to int8 (q - 8), which makes a Q4_0 matrix a Q8_0 one
with small integers: kernel, twin and row reader are q8_0's.

Not here: a kernel of its own (Q8_0's is exact for it), shape checks, quantization.
"""

# Q4_0 block, 18 bytes for 32 weights: d f16 | qs 16 x u8, little-endian;
# qs[j] holds q[j] in its low nibble and q[j + 16] in its high nibble; w = d * (q - 8).

from __future__ import annotations

import numpy as np

from cfr_atlas.quant import q8_0
from cfr_atlas.quant.formats import BLOCKS, Codec, QType
from cfr_atlas.quant.tiles import to_tiles

QK = BLOCKS[QType.Q4_0].elements
BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
assert BLOCK.itemsize == BLOCKS[QType.Q4_0].bytes
assert QK == q8_0.QK  # the tiles share q8_0's block of scales
OFFSET = np.int8(8)  # stored nibbles are q + 8

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


def repack(raw: np.ndarray) -> q8_0.Tiles:
    """raw (N, row_bytes) uint8 -> q8_0.Tiles of q - 8: 1 byte per weight plus the scales."""
    d, q = _fields(raw)
    return q8_0.Tiles(to_tiles(q), to_tiles(d))


CODEC = Codec(QType.Q4_0, np.dtype(np.uint8), dequantize, repack, q8_0.unpack_rows, q8_0.matmul,
              q8_0.matmul_numpy)
