"""Raw GGUF bytes for the quant tests: made by gguf's own quantizer or built by hand block by block.

Holds data builders and one bit-comparison helper; no assertions about cfr_atlas behaviour.
"""

from __future__ import annotations

import gguf
import numpy as np
from gguf import GGMLQuantizationType

from cfr_atlas.quant import QType, q4_0, q4_1, q8_0

GGML = {qt: GGMLQuantizationType(qt.value) for qt in QType}
BLOCK_FORMATS = {QType.Q8_0: q8_0.BLOCK, QType.Q4_0: q4_0.BLOCK, QType.Q4_1: q4_1.BLOCK}
FLOAT_FORMATS = (QType.F32, QType.F16, QType.BF16)

# f16 scale edge values: zeros of both signs, the smallest subnormal and normal, the largest
# finite value, and ordinary ones.
F16_EDGES = np.array(
    [0.0, -0.0, 2.0**-24, -(2.0**-24), 2.0**-14, 65504.0, -65504.0, 1.0, -0.5, 0.0078125],
    dtype=np.float16,
)


def quantized(qtype: QType, n: int, k: int, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """A (n, k) standard-normal matrix through gguf.quants.quantize, as a GGUF file stores it."""
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


def edge_raw(qtype: QType, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Block-format bytes (n, row_bytes) with edge scales (F16_EDGES, then random finite f16,
    subnormals included) and quants spanning the full range, extremes forced in every block."""
    rng = np.random.default_rng(seed)
    blocks = np.zeros((n, k // 32), dtype=BLOCK_FORMATS[qtype])
    for field in ("d", "m"):
        if field in blocks.dtype.names:
            bits = finite_f16_bits(rng, blocks.shape)
            bits.reshape(-1)[: F16_EDGES.size] = F16_EDGES.view(np.uint16)[: bits.size]
            blocks[field] = bits.view(np.float16)
    qs = blocks["qs"]
    if qs.dtype == np.int8:
        qs[:] = rng.integers(-128, 128, size=qs.shape)
        qs[..., 0], qs[..., 1] = -128, 127
    else:
        qs[:] = rng.integers(0, 256, size=qs.shape)
        qs[..., 0], qs[..., 1] = 0x00, 0xFF  # nibbles 0, 0 and 15, 15
    return blocks.view(np.uint8).reshape(n, -1)


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    """float32 arrays identical bit for bit (NaN payloads and signed zeros included)."""
    assert a.dtype == b.dtype == np.float32 and a.shape == b.shape, (a.dtype, b.dtype, a.shape,
                                                                     b.shape)
    diff = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32))
    assert diff.size == 0, f"{diff.size} elements differ, first at {diff[0]}: " \
        f"{a.reshape(-1)[diff[0]]!r} vs {b.reshape(-1)[diff[0]]!r}"
