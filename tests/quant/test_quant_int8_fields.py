"""The integer path of the sub-block formats with sub-blocks of 32 (quant/int8_fields.py): Q5_0,
Q5_1, IQ4_NL, Q4_K, Q5_K: kernels bit for bit equal to their NumPy twins at K-quant shapes and
the integer SIMD in the emitted assembly. Edge scales and non-finite activations, reads equal
to gguf-py's values, batch invariance and the error bound against float64 run for them in
test_quant_int8.py (EVERY_INT8). Q6_K, Q2_K and Q3_K keep their float codec (tested below)."""

import numba
import numpy as np
import pytest
from quant_data import assert_bits_equal, quantized
from test_quant_int8 import _cpu_flags, _twin, _x

from cfr_atlas.quant import QType, QuantWeight, int8, int8_fields
from cfr_atlas.quant.weight import CODECS, INT8_CODECS, INT8_FIELDS

FORMATS = list(INT8_FIELDS)
SHAPES = [(1, 256), (17, 512), (70, 768)]  # K: whole 256-weight super-blocks for the K-quants


def _int8(qtype, raw, shape) -> QuantWeight:
    return QuantWeight.from_raw("w", qtype, raw, shape, arithmetic="int8")


def test_the_formats_with_sub_blocks_of_32_have_an_integer_codec():
    assert set(FORMATS) == {QType.Q5_0, QType.Q5_1, QType.IQ4_NL, QType.Q4_K, QType.Q5_K}
    for qt in FORMATS:
        assert INT8_CODECS[qt] is not CODECS[qt]
    for qt in (QType.Q6_K, QType.Q2_K, QType.Q3_K):  # sub-blocks of 16: float under int8
        assert INT8_CODECS[qt] is CODECS[qt]


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 5])
def test_kernel_equals_twin(qtype, shape, t):
    w = _int8(qtype, quantized(qtype, *shape, seed=t), shape)
    x = _x(t, shape[1], seed=shape[0])
    assert_bits_equal(w.matmul(x), _twin(w, x))


@pytest.mark.parametrize("has_m", [False, True])
def test_integer_simd_in_assembly(has_m):
    """Both kernels (SCALE and MIN on int8 bytes) dot with vpmaddubsw + vpmaddwd on AVX2."""
    if "avx2" not in _cpu_flags() or not int8.AVX2:
        pytest.skip("no AVX2 in /proc/cpuinfo or on numba's target: portable IR is emitted")
    qtype = QType.Q4_K if has_m else QType.Q5_0
    _int8(qtype, quantized(qtype, 16, 256), (16, 256)).matmul(np.ones((1, 256), np.float32))
    kernel = int8_fields._KERNELS[has_m]
    fresh = numba.njit(parallel=True)(kernel.py_func)  # numba cannot inspect cached code
    sig = kernel.signatures[0]
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    for op in ("vpmaddubsw", "vpmaddwd"):
        assert op in asm, op
