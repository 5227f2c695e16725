"""Raw GGUF bytes for the quant tests: made by gguf's own quantizer or built by hand block by block.

Holds data builders and one bit-comparison helper; no assertions about cfr_atlas behaviour.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from cfr_atlas.quant import BLOCKS, QType, kquants, q4_0, q4_1, q5, q8_0

GGML = {qt: GGMLQuantizationType(qt.value) for qt in QType}
BLOCK_FORMATS = {QType.Q8_0: q8_0.BLOCK, QType.Q4_0: q4_0.BLOCK, QType.Q4_1: q4_1.BLOCK,
                 **q5.BLOCK_DTYPES, **kquants.BLOCK_DTYPES}
FLOAT_FORMATS = (QType.F32, QType.F16, QType.BF16)
# gguf-py has no quantizer for these; `quantized` builds their blocks from random bytes.
NO_QUANTIZER = (QType.IQ4_NL, *kquants.BLOCK_DTYPES)

# f16 scale edge values: zeros of both signs, the smallest subnormal and normal, the largest
# finite value, and ordinary ones.
F16_EDGES = np.array(
    [0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-14, 65504.0, -65504.0, 1.0, -0.5, 0.0078125],
    dtype=np.float16,
)


def cols(qtype: QType, k: int) -> int:
    """k columns of a 32-weight-block test case, as many blocks of this format's block size."""
    elements = BLOCKS[qtype].elements
    return k if elements == 1 else k // 32 * elements


def quantized(qtype: QType, n: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """A (n, k) standard-normal matrix through gguf.quants.quantize, as a GGUF file stores it;
    for formats gguf cannot quantize, random quant and scale bytes with f16 scales d (and dmin)
    drawn from [0.001, 0.01) * scale, the range real K-quant files hold."""
    if qtype in NO_QUANTIZER:
        return random_blocks(qtype, n, k, np.random.default_rng(seed), scale)
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * np.float32(scale)
    return gguf.quants.quantize(w, GGML[qtype])


def reference(qtype: QType, raw: np.ndarray) -> np.ndarray:
    """gguf-py's dequantization, the ground truth."""
    return gguf.quants.dequantize(raw, GGML[qtype])


def finite_f16_bits(rng: np.random.Generator, shape) -> np.ndarray:
    """Uniformly random float16 bit patterns with the inf/NaN exponent excluded (uint16)."""
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    special = (bits & np.uint16(0x7C00)) == np.uint16(0x7C00)
    return np.where(special, bits & np.uint16(0xBFFF), bits)


def _f16_fields(dtype: np.dtype) -> list[str]:
    return [f for f in dtype.names if dtype[f] == np.dtype("<f2")]


def _packed_fields(dtype: np.dtype) -> list[str]:
    """The byte-array fields (quants, packed scales, high bits) of a block dtype."""
    return [f for f in dtype.names if dtype[f] != np.dtype("<f2")]


def random_blocks(qtype: QType, n: int, k: int, rng: np.random.Generator,
                  scale: float = 1.0) -> np.ndarray:
    """(n, row_bytes) bytes: every packed field uniformly random, f16 fields in
    [0.001, 0.01) * scale."""
    dtype = BLOCK_FORMATS[qtype]
    raw = rng.integers(0, 256, size=(n, k // BLOCKS[qtype].elements * dtype.itemsize),
                       dtype=np.uint8)
    blocks = raw.view(dtype)
    for field in _f16_fields(dtype):
        blocks[field] = (rng.uniform(1e-3, 1e-2, blocks.shape) * scale).astype(np.float16)
    return raw


def edge_raw(qtype: QType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Block-format bytes (n, row_bytes) with edge scales (F16_EDGES, then random finite f16,
    subnormals included) and quants spanning the full range, extremes forced in every block:
    byte 0 of each `qs` 0x00 and byte 1 0xFF (int8: -128 and 127); the first four blocks hold
    0x00, 0xFF, 0x80, 0x7F in every packed byte (all-zero and all-one bit planes and scales,
    int8 -128 and 127)."""
    rng = np.random.default_rng(seed)
    dtype = BLOCK_FORMATS[qtype]
    raw = rng.integers(0, 256, size=(n, k // BLOCKS[qtype].elements * dtype.itemsize),
                       dtype=np.uint8)
    blocks = raw.view(dtype)
    for field in _f16_fields(dtype):
        bits = finite_f16_bits(rng, blocks.shape)
        bits.reshape(-1)[: F16_EDGES.size] = F16_EDGES.view(np.uint16)[: bits.size]
        blocks[field] = bits.view(np.float16)
    if "qs" in dtype.names:
        signed = dtype["qs"].base == np.int8
        qs = blocks["qs"].view(np.uint8)
        qs[..., 0], qs[..., 1] = (0x80, 0x7F) if signed else (0x00, 0xFF)  # nibbles 0 and 15
    flat = blocks.reshape(-1)
    for i, byte in enumerate((0x00, 0xFF, 0x80, 0x7F)[: flat.size]):
        for field in _packed_fields(dtype):
            flat[i : i + 1][field].view(np.uint8)[:] = byte
    return raw


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """float32 arrays identical bit for bit (NaN payloads and signed zeros included)."""
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, (a.dtype, b.dtype, a.shape,
                                                                     b.shape)
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{diff.size} elements differ, first at {diff[0]}: " \
        f"{a.reshape(-1)[diff[0]]!r} vs {b.reshape(-1)[diff[0]]!r}"
