"""The integer path of the sub-block formats with sub-blocks of 32 (quant/int8_fields.py): Q5_0,
Q5_1, IQ4_NL, Q4_K, Q5_K: kernels bit for bit equal to their NumPy twins at K-quant shapes and
the integer SIMD in the emitted assembly. Edge scales and non-finite activations, reads equal
to gguf-py's values, batch invariance and the error bound against float64 run for them in
test_quant_int8.py (EVERY_INT8). Q6_K and Q3_K (sub-blocks of 16) are test_quant_int8_sub16.py's;
Q2_K keeps its float codec (tested there)."""

import numba
import numpy as np
import pytest
from quant_data import assert_bits_equal, quantized
from test_quant_int8 import _cpu_flags, _twin, _x, simd_ops

from cfr_atlas.quant import QType, QuantWeight, int8, int8_fields
from cfr_atlas.quant.subblock import Offset
from cfr_atlas.quant.weight import CODECS, INT8_CODECS, INT8_FIELDS

FORMATS = list(INT8_FIELDS)
SHAPES = [(1, 256), (17, 512), (70, 768)]  # K: whole 256-weight super-blocks for the K-quants


def _int8(qtype, raw, shape) -> QuantWeight:
    return QuantWeight.from_raw("w", qtype, raw, shape, arithmetic="int8")


def test_the_formats_with_sub_blocks_of_32_have_an_integer_codec():
    assert set(FORMATS) == {QType.Q5_0, QType.Q5_1, QType.IQ4_NL, QType.Q4_K, QType.Q5_K}
    for qt in FORMATS:
        assert INT8_CODECS[qt] is not CODECS[qt]
    for qt in (QType.Q6_K, QType.Q2_K, QType.Q3_K):  # sub-blocks of 16: not this module's
        assert qt not in INT8_FIELDS


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 5, 7])
def test_kernel_equals_twin(qtype, shape, t):
    w = _int8(qtype, quantized(qtype, *shape, seed=t), shape)
    x = _x(t, shape[1], seed=shape[0])
    assert_bits_equal(w.matmul(x), _twin(w, x))


@pytest.mark.parametrize("qtype", FORMATS)
def test_integer_simd_in_assembly(qtype):
    """Every kernel (SCALE and MIN on int8 bytes, MIN on Q4_K's nibbles, OFFSET16 and MIN on
    5-bit weights) dots with vpmaddubsw + vpmaddwd on AVX2 (vpdpbusd with VNNI), and none
    reduces across lanes (no vphaddd)."""
    if "avx2" not in _cpu_flags() or not int8.AVX2:
        pytest.skip("no AVX2 in /proc/cpuinfo or on numba's target: portable IR is emitted")
    _int8(qtype, quantized(qtype, 16, 256), (16, 256)).matmul(np.ones((1, 256), np.float32))
    _, offset, width, _ = INT8_FIELDS[qtype]
    kernel = int8_fields._KERNELS[offset is not Offset.NONE, width]
    fresh = numba.njit(parallel=True)(kernel.py_func)  # numba cannot inspect cached code
    sig = kernel.signatures[0]
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    for op in simd_ops():
        assert op in asm, op
    assert "vphaddd" not in asm


def test_weights_are_kept_at_the_width_of_their_values():
    """Q4_K's integer tiles hold half a byte per weight, the 5-bit formats' 5/8 of a byte
    (nibbles + a plane of high bits), IQ4_NL's one byte; scales that are GGUF's float16 values
    stay float16 (their bits: Q5_0's tiles are then exactly GGUF's 5.5 bits a weight), the
    K-quants' products d * sc float32."""
    half, single = np.uint16, np.float32
    for qtype, per_weight, scale in ((QType.Q4_K, 0.5, single), (QType.Q5_0, 0.625, half),
                                     (QType.Q5_1, 0.625, half), (QType.Q5_K, 0.625, single),
                                     (QType.IQ4_NL, 1.0, half)):
        w = _int8(qtype, quantized(qtype, 64, 512), (64, 512))
        assert w.tiles.q.nbytes == 64 * 512 * per_weight
        assert w.tiles.d.dtype == scale and w.tiles.d.nbytes == 64 * 512 // 32 * scale().itemsize
        has_m = INT8_FIELDS[qtype][1] is not Offset.NONE
        assert w.tiles.m.dtype == scale and w.tiles.m.nbytes == (w.tiles.d.nbytes if has_m else 0)
