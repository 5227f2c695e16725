"""Numba kernels against their NumPy twins (bit for bit) and against float64 (a stated bound).

Error bound. The kernels sum y = sum_k w_k x_k per block (or sub-block) of QK = 32 or 16 columns
as PHASES = 4 chains of QK / 4 products, combine the chains pairwise (2 adds), apply the block's
scale (and, for Q4_1 and the offset sub-block formats, add m_b times the block sum of x, itself
QK / 4 + 1 roundings deep), then add the block into a single accumulator, block after block.
Every term passes through at most n = QK / PHASES + 6 + nb float32 roundings, so the standard
bound gives |y_kernel - y| <= gamma_n * M, gamma_n = n u / (1 - n u), u = 2**-24, with M the sum
of the absolute values of the terms the kernel adds: sum_k |x_k| (|a_b q_k| + |c_b|) for Q4_1 and
the sub-block formats (their kernels split w = a q + c), sum_k |x_k w_k| otherwise. The float64
reference uses the dequantized w, which gguf-py rounds once more for Q4_1, Q5_1, Q2_K, Q4_K, Q5_K
(at the add) and Q6_K (a q needs 25 bits), so it is allowed one extra u * M.
"""

import numpy as np
import pytest
from quant_data import BLOCK_FORMATS, GGML, cols, edge_raw, quantized, reference

from cfr_atlas.quant import BLOCKS, QType, QuantWeight, kquants, q5
from cfr_atlas.quant.q4_1 import _fields as q4_1_fields
from cfr_atlas.quant.tiles import PHASES
from cfr_atlas.quant.weight import CODECS

# Unpackers of the sub-block formats (w = a_s q + c_s), and their sub-block size QK.
SUBBLOCK_FIELDS = {
    QType.Q5_0: (q5.q5_0_fields, 32), QType.Q5_1: (q5.q5_1_fields, 32),
    QType.IQ4_NL: (q5.iq4_nl_fields, 32), QType.Q4_K: (kquants.q4_k_fields, 32),
    QType.Q5_K: (kquants.q5_k_fields, 32), QType.Q6_K: (kquants.q6_k_fields, 16),
    QType.Q2_K: (kquants.q2_k_fields, 16), QType.Q3_K: (kquants.q3_k_fields, 16),
}

U = 2.0**-24


def _x(t, k, seed=0):
    return np.random.default_rng(seed).standard_normal((t, k)).astype(np.float32)


def _both(w: QuantWeight, x: np.ndarray):
    """(kernel output, twin output) for x (T, K)."""
    twin = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    CODECS[w.qtype].matmul_numpy(x, w.tiles, twin)
    return w.matmul(x), twin


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("shape", [(1, 32), (17, 64), (70, 96), (33, 40)])
@pytest.mark.parametrize("t", [1, 2, 5])
def test_kernel_equals_twin(qtype, shape, t):
    if shape[1] % BLOCKS[qtype].elements:
        pytest.skip("row size splits a block")
    w = QuantWeight.from_raw("w", qtype, quantized(qtype, *shape, seed=t), shape)
    kernel, twin = _both(w, _x(t, shape[1], seed=shape[0]))
    np.testing.assert_array_equal(kernel.view(np.uint32), twin.view(np.uint32))


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS))
def test_kernel_equals_twin_on_edge_blocks(qtype):
    k = cols(qtype, 128)
    raw = edge_raw(qtype, 45, k, seed=4)
    w = QuantWeight.from_raw("w", qtype, raw, (45, k))
    x = _x(6, k, seed=5) * np.float32(2.0) ** (np.arange(k, dtype=np.float32)
                                                * np.float32(40 / k) - np.float32(20))
    x[0, :7] = [0.0, -0.0, 1e-40, -1e-40, 3e-38, 1.0, -1.0]
    kernel, twin = _both(w, x)
    np.testing.assert_array_equal(kernel, twin)  # NaN-free here; equal_nan covers the rest


@pytest.mark.parametrize("qtype", [QType.F16, QType.BF16])
def test_kernel_widens_every_finite_16_bit_pattern(qtype):
    """X = I picks columns out exactly, so the kernel's bit-twiddled widening must match
    NumPy's cast for every finite pattern (subnormals and signed zeros included)."""
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    special = np.uint16(0x7C00 if qtype is QType.F16 else 0x7F80)
    bits = bits[(bits & special) != special]
    bits = np.concatenate([bits, np.zeros(-bits.size % 32, dtype=np.uint16)]).reshape(-1, 32)
    w = QuantWeight.from_raw("w", qtype, bits.view(np.uint8), bits.shape)
    y = w.matmul(np.eye(32, dtype=np.float32))
    np.testing.assert_array_equal(y.T, w.dequantize())


@pytest.mark.parametrize("qtype", [QType.F32, QType.F16, QType.BF16])
def test_infinite_weights(qtype):
    wf = np.ones((3, 32), dtype=np.float32)
    wf[1, 5], wf[2, 7] = np.inf, -np.inf
    raw = {QType.F32: wf, QType.F16: wf.astype(np.float16),
           QType.BF16: (wf.view(np.uint32) >> 16).astype(np.uint16)}[qtype]
    w = QuantWeight.from_raw("w", qtype, raw.view(np.uint8), (3, 32))
    kernel, twin = _both(w, np.ones((1, 32), dtype=np.float32))
    np.testing.assert_array_equal(kernel, [[32.0, np.inf, -np.inf]])
    np.testing.assert_array_equal(twin, kernel)


def _abs_terms(qtype, raw, x):
    """M of the module docstring: (T, N) float64 sums of |terms| the kernel adds."""
    if qtype is QType.Q4_1 or qtype in SUBBLOCK_FIELDS:
        fields, qk = SUBBLOCK_FIELDS.get(qtype, (q4_1_fields, 32))
        d, m, q = fields(raw)
        m = np.zeros_like(d) if m is None else m
        d, m, q = (a.astype(np.float64) for a in (d, m, q))
        dq = np.abs(np.repeat(d, qk, axis=1) * q)
        mm = np.repeat(np.abs(m), qk, axis=1)
        return np.abs(x).astype(np.float64) @ (dq + mm).T
    w = reference(qtype, raw).astype(np.float64)
    return np.abs(x).astype(np.float64) @ np.abs(w).T


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("shape", [(64, 576), (40, 1536)])
def test_accuracy_against_float64(qtype, shape):
    n, k = shape[0], cols(qtype, shape[1])
    raw = quantized(qtype, n, k, seed=7)
    w = QuantWeight.from_raw("w", qtype, raw, (n, k))
    x = _x(3, k, seed=8)
    y = w.matmul(x).astype(np.float64)
    ref = x.astype(np.float64) @ reference(qtype, raw).astype(np.float64).T
    qk = SUBBLOCK_FIELDS.get(qtype, (None, 32))[1]
    rounds = qk // PHASES + 6 + k // qk + 1
    bound = rounds * U / (1 - rounds * U) * _abs_terms(qtype, raw.view(np.uint8), x)
    assert np.all(np.abs(y - ref) <= bound), np.max(np.abs(y - ref) / bound)
    # and the bound is not vacuous: the typical error is far below it
    assert np.median(np.abs(y - ref) / bound) < 0.1


def test_real_shape_q4_1_and_q8_0():
    """The bundled model's smallest real shape through both of its formats, kernel vs twin."""
    for qtype in (QType.Q4_1, QType.Q8_0):
        raw = quantized(qtype, 192, 576, seed=9)
        kernel, twin = _both(QuantWeight.from_raw("w", GGML[qtype], raw, (192, 576)),
                             _x(4, 576, seed=10))
        np.testing.assert_array_equal(kernel.view(np.uint32), twin.view(np.uint32))
