"""Dequantization bitwise equal to gguf.quants.dequantize, from raw bytes and from the tiles.

Covers quantizer output, hand-built edge blocks (zero and negative-zero scales, f16 subnormal
and extreme scales, nibbles 0 and 15, int8 -128 and 127) and every 16-bit float bit pattern.
"""

import numpy as np
import pytest
from quant_data import (
    BLOCK_FORMATS,
    assert_bits_equal,
    cols,
    edge_raw,
    quantized,
    reference,
)

from cfr_atlas.quant import TILE_ROWS, QType, QuantWeight
from cfr_atlas.quant.weight import CODECS


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("shape", [(1, 32), (19, 96), (64, 576)])
def test_quantized_data(qtype, shape):
    shape = (shape[0], cols(qtype, shape[1]))
    raw = quantized(qtype, *shape, seed=shape[0])
    ref = reference(qtype, raw)
    assert_bits_equal(CODECS[qtype].dequantize(raw.view(np.uint8).reshape(shape[0], -1)), ref)
    w = QuantWeight.from_raw("w", qtype, raw, shape)
    assert_bits_equal(w.dequantize(), ref)


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS))
def test_edge_blocks(qtype):
    k = cols(qtype, 128)
    raw = edge_raw(qtype, 37, k, seed=1)
    ref = reference(qtype, raw)
    assert_bits_equal(CODECS[qtype].dequantize(raw), ref)
    assert_bits_equal(QuantWeight.from_raw("w", qtype, raw, (37, k)).dequantize(), ref)


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16])
def test_every_16_bit_pattern(qtype):
    """All 65536 patterns: subnormals, both zeros, infinities and NaN payloads."""
    raw = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.uint8).reshape(256, -1)
    ref = reference(qtype, raw.view(np.float16) if qtype is QType.F16 else raw)
    assert_bits_equal(CODECS[qtype].dequantize(raw), ref)
    assert_bits_equal(QuantWeight.from_raw("w", qtype, raw, (256, 256)).dequantize(), ref)


def test_f32_bits_pass_through():
    bits = np.random.default_rng(2).integers(0, 1 << 32, size=(9, 40), dtype=np.uint32)
    raw = bits.view(np.uint8)
    assert_bits_equal(CODECS[QType.F32].dequantize(raw), bits.view(np.float32))
    assert_bits_equal(QuantWeight.from_raw("w", QType.F32, raw, (9, 40)).dequantize(),
                      bits.view(np.float32))


@pytest.mark.parametrize("qtype", list(QType))
def test_rows_dequantize_only_the_requested_rows(qtype):
    k = cols(qtype, 64)
    raw = quantized(qtype, 50, k, seed=3)
    ref = reference(qtype, raw)
    w = QuantWeight.from_raw("w", qtype, raw, (50, k))
    ids = np.array([49, 0, 17, 17, 16, 15, 33], dtype=np.int64)
    assert_bits_equal(w.rows(ids), ref[ids])
    out = np.empty((ids.size, k), dtype=np.float32)
    assert w.rows(ids, out=out) is out
    assert_bits_equal(out, ref[ids])
    assert w.rows(np.array([], dtype=np.int32)).shape == (0, k)


@pytest.mark.parametrize("qtype", list(QType))
def test_repacked_size(qtype):
    """Block formats hold 1 byte per weight plus float32 scales (and offsets) per sub-block of
    16 or 32 weights; floats keep their width. Rows are whole tiles here (no padding)."""
    n, k = 2 * TILE_ROWS, cols(qtype, 576)
    w = QuantWeight.from_raw("w", qtype, quantized(qtype, n, k), (n, k))
    scales = {QType.Q4_1: (32, 2), QType.Q8_0: (32, 1), QType.Q4_0: (32, 1),
              QType.Q5_0: (32, 1), QType.Q5_1: (32, 2), QType.IQ4_NL: (32, 1),
              QType.Q4_K: (32, 2), QType.Q5_K: (32, 2), QType.Q6_K: (16, 1),
              QType.Q2_K: (16, 2), QType.Q3_K: (16, 1)}.get(qtype)
    if scales is None:
        assert w.nbytes == n * k * np.dtype(CODECS[qtype].raw_dtype).itemsize
    else:
        sub, arrays = scales
        assert w.nbytes == n * k + n * (k // sub) * 4 * arrays
