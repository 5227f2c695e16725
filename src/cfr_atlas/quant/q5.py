"""Q5_0, Q5_1 and IQ4_NL: the 32-weight blocks beyond Q4/Q8 (Q5_0 appears in Q4_K_M files).
Each unpacks its bytes into subblock.Fields (one sub-block per block); layout, kernels, twin and
row reader are subblock.py's.

Not here: kernels of their own, shape checks (weight.py), quantization.
"""

# Q5_0 block, 22 bytes for 32 weights: d f16 | qh 4 x u8 | qs 16 x u8, little-endian;
#   q[j] = (qs[j] & 0xF) | bit j of qh << 4, q[j + 16] = (qs[j] >> 4) | bit (j + 16) of qh << 4,
#   bit j of qh being bit j % 8 of qh[j // 8]; w = d * (q - 16).
# Q5_1 block, 24 bytes: d f16 | m f16 | qh 4 x u8 | qs 16 x u8, q as Q5_0; w = d * q + m.
# IQ4_NL block, 18 bytes: d f16 | qs 16 x u8, nibbles as Q4_0; w = d * KVALUES[nibble].

from __future__ import annotations

import numpy as np

from cfr_atlas.quant import subblock
from cfr_atlas.quant.formats import BLOCKS, QType
from cfr_atlas.quant.subblock import Fields, bit_fields

QK = 32
Q5_0_BLOCK = np.dtype([("d", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (QK // 2,))])
Q5_1_BLOCK = np.dtype([("d", "<f2"), ("m", "<f2"), ("qh", "u1", (4,)), ("qs", "u1", (QK // 2,))])
IQ4_NL_BLOCK = np.dtype([("d", "<f2"), ("qs", "u1", (QK // 2,))])
BLOCK_DTYPES = {QType.Q5_0: Q5_0_BLOCK, QType.Q5_1: Q5_1_BLOCK, QType.IQ4_NL: IQ4_NL_BLOCK}
for _qtype, _dtype in BLOCK_DTYPES.items():
    assert _dtype.itemsize == BLOCKS[_qtype].bytes and BLOCKS[_qtype].elements == QK

# The non-linear 4-bit codebook of IQ4_NL (ggml's kvalues_iq4nl).
KVALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                   dtype=np.int8)

# Rounding facts: d * q is exact in float32 for all three (an 11-bit significand times an integer
# of at most 8 bits), so Q5_0 and IQ4_NL dequantize without rounding and Q5_1 rounds once, at the
# add, exactly as gguf-py's `(d * q) + m`.


def _nibbles(blocks: np.ndarray) -> np.ndarray:
    """blocks (rows, nb) -> (rows, nb, 32) uint8: low nibbles of qs, then the high ones."""
    return bit_fields(blocks["qs"], 4).reshape(*blocks.shape, QK)


def _five_bits(blocks: np.ndarray) -> np.ndarray:
    """blocks (rows, nb) of Q5_0/Q5_1 -> (rows, nb * 32) uint8 q in 0..31."""
    high = np.unpackbits(blocks["qh"], axis=-1, bitorder="little")  # bit j at [..., j]
    return (_nibbles(blocks) | (high << np.uint8(4))).reshape(blocks.shape[0], -1)


def _f32(blocks: np.ndarray, field: str) -> np.ndarray:
    return blocks[field].astype(np.float32)


def q5_0_fields(raw: np.ndarray) -> Fields:
    blocks = np.ascontiguousarray(raw).view(Q5_0_BLOCK)
    q = _five_bits(blocks).view(np.int8) - np.int8(16)
    return Fields(_f32(blocks, "d"), None, q)


def q5_1_fields(raw: np.ndarray) -> Fields:
    blocks = np.ascontiguousarray(raw).view(Q5_1_BLOCK)
    return Fields(_f32(blocks, "d"), _f32(blocks, "m"), _five_bits(blocks).view(np.int8))


def iq4_nl_fields(raw: np.ndarray) -> Fields:
    blocks = np.ascontiguousarray(raw).view(IQ4_NL_BLOCK)
    return Fields(_f32(blocks, "d"), None, KVALUES[_nibbles(blocks)].reshape(raw.shape[0], -1))


CODECS = (
    subblock.codec(QType.Q5_0, q5_0_fields, QK, offset=False),
    subblock.codec(QType.Q5_1, q5_1_fields, QK, offset=True),
    subblock.codec(QType.IQ4_NL, iq4_nl_fields, QK, offset=False),
)
