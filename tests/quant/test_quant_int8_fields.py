"""The integer path of the sub-block formats with sub-blocks of 32 (quant/int8_fields.py): Q5_0,
Q5_1, IQ4_NL, Q4_K, Q5_K. Kernels bit for bit equal to their NumPy twins (edge scales and
non-finite activations included), reads equal to the float path's and to gguf-py's values,
batch invariance, the error bound of test_quant_int8.py against float64, and the integer SIMD
in the emitted assembly. Q6_K, Q2_K and Q3_K keep their float codec (tested below)."""

import numba
import numpy as np
import pytest
from quant_data import assert_bits_equal, edge_raw, quantized, reference
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


@pytest.mark.parametrize("qtype", FORMATS)
def test_kernel_equals_twin_on_edge_blocks_and_non_finite(qtype):
    w = _int8(qtype, edge_raw(qtype, 45, 512, seed=4), (45, 512))
    x = _x(6, 512, seed=5)
    x[0, :5] = [0.0, -0.0, 1e-40, -1e-40, 3e38]
    x[1, 40], x[2, 300] = np.nan, -np.inf  # NaN rows where those blocks feed them
    y = w.matmul(x)
    np.testing.assert_array_equal(y, _twin(w, x))
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all()


@pytest.mark.parametrize("qtype", FORMATS)
def test_rows_and_dequantize_read_the_int8_layout(qtype):
    raw = edge_raw(qtype, 45, 512, seed=8)
    w = _int8(qtype, raw, (45, 512))
    ref = reference(qtype, raw)
    assert_bits_equal(w.dequantize(), ref)
    ids = np.array([44, 0, 17, 16, 17])
    assert_bits_equal(w.rows(ids), ref[ids])
    assert w.tiles.q.nbytes == 64 * 512  # one byte a weight, rows padded to whole tiles


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("t", [1, 2, 3, 7, 64])
def test_rows_equal_matvec_chunks_and_threads(qtype, t):
    w = _int8(qtype, quantized(qtype, 100, 256, seed=t), (100, 256))
    x = _x(t, 256, seed=t + 1)
    y = w.matmul(x)
    for i in range(t):
        assert_bits_equal(y[i], w.matvec(x[i]))
    bounds = [0, *sorted({c for c in (1, 3, 4, 11) if c < t}), t]
    chunks = [w.matmul(x[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert_bits_equal(np.concatenate(chunks), y)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert_bits_equal(w.matmul(x, out=np.full_like(y, np.nan)), y)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("qtype", FORMATS)
def test_accuracy_against_float64(qtype):
    """|y - W x| <= sum_b (d_x,b / 2) sum_j |w_bj| plus float32 rounding of the per-block
    terms (the bound of test_quant_int8.py), and the bound is not vacuous."""
    n, k = 64, 1536
    raw = quantized(qtype, n, k, seed=7)
    x = _x(3, k, seed=8)
    y = _int8(qtype, raw, (n, k)).matmul(x).astype(np.float64)
    w = reference(qtype, raw).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    _, d, _ = int8.quantize_numpy(x)
    wabs = np.abs(w).reshape(n, -1, 32).sum(axis=-1)
    act = 0.5 * (1 + 1e-6) * d.astype(np.float64) @ wabs.T
    rounding = (k // 32 + 4) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T) * 2
    err = np.abs(y - exact)
    assert np.all(err <= act + rounding)
    assert np.median(err / (act + rounding)) < 0.2


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
