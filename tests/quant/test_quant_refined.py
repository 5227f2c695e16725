"""QuantWeight.matmul_refined (the output head under --matmul int8): x and its quantization
residual (int8.with_residual) through the integer kernel, summed. Checked: the residual against
its definition, the result against the two passes computed by hand, batch invariance, an error
bound against float64, the refined error at least 100x under one 8-bit pass's (measured
135-380x; the bound's ratio is 254x), and the float fallback."""

import numba
import numpy as np
import pytest
from quant_data import assert_bits_equal, quantized, reference

from cfr_atlas.errors import DimensionError
from cfr_atlas.quant import QType, QuantWeight, int8
from cfr_atlas.quant.weight import CODECS, INT8_CODECS

# every format with an integer path (Q6_K is the usual output head of a Q4_K_M file)
INTEGER = [qt for qt, c in INT8_CODECS.items() if c is not CODECS[qt]]


def _w(qtype, n, k, arithmetic="int8", seed=0) -> QuantWeight:
    return QuantWeight.from_raw("head", qtype, quantized(qtype, n, k, seed=seed), (n, k),
                                arithmetic=arithmetic)


def _x(t: int, k: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)) * 2.0 ** rng.integers(-8, 8, size=(t, 1))
    x[rng.random((t, k)) < 0.05] = 0.0
    return x.astype(np.float32)


def test_residual_rows_by_definition():
    x = _x(5, 256, seed=1)
    pair = int8.with_residual(x)
    assert pair.shape == (10, 256) and pair.dtype == np.float32
    assert_bits_equal(pair[0::2], x)
    xq, d, _ = int8.quantize_numpy(x)
    deq = (xq.reshape(5, -1, 32).astype(np.float32) * d[..., None]).reshape(5, 256)
    assert_bits_equal(pair[1::2], x - deq)
    # the residual of a block is at most half its step (plus float32 rounding of d q)
    r = np.abs(pair[1::2]).reshape(5, -1, 32).max(axis=-1)
    assert np.all(r <= d * np.float32(0.5 + 1e-5))
    assert np.any(r > d * np.float32(0.25))  # not trivially zero


def test_non_finite_block_gives_nan_outputs_only_where_it_feeds():
    w = _w(QType.Q8_0, 40, 64)
    x = _x(2, 64, seed=2)
    x[1, 40] = np.inf
    y = w.matmul_refined(x)
    assert np.all(np.isfinite(y[0])) and np.all(np.isnan(y[1]))


@pytest.mark.parametrize("qtype", INTEGER)
def test_refined_is_the_sum_of_two_integer_passes(qtype):
    w = _w(qtype, 70, 256, seed=3)
    assert w.integer
    x = _x(3, 256, seed=4)
    pair = int8.with_residual(x)
    y = w.matmul(pair)
    assert_bits_equal(w.matmul_refined(x), y[0::2] + y[1::2])
    out = np.full((3, 70), np.nan, dtype=np.float32)
    assert w.matmul_refined(x, out=out) is out
    assert_bits_equal(out, y[0::2] + y[1::2])


@pytest.mark.parametrize("qtype", INTEGER)
@pytest.mark.parametrize("t", [1, 2, 5])
def test_refined_rows_are_batch_invariant(qtype, t):
    w = _w(qtype, 100, 256, seed=t)
    x = _x(t, 256, seed=t + 10)
    y = w.matmul_refined(x)
    for i in range(t):
        assert_bits_equal(y[i:i + 1], w.matmul_refined(x[i:i + 1]))
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert_bits_equal(w.matmul_refined(x), y)
    finally:
        numba.set_num_threads(before)


@pytest.mark.parametrize("qtype", INTEGER)
def test_refined_error_against_float64(qtype):
    """One 8-bit pass errs by up to sum_b (d_b / 2) sum_j |w_bj|; the residual pass leaves
    (d_r,b / 2) with d_r,b <= d_b / 254, plus float32 rounding of the per-block terms of both
    passes and of their sum. Measured: the refined error is far below the plain pass's."""
    n, k = 64, 1536
    raw = quantized(qtype, n, k, seed=7)
    w = QuantWeight.from_raw("head", qtype, raw, (n, k), arithmetic="int8")
    x = _x(3, k, seed=8)
    exact = x.astype(np.float64) @ reference(qtype, raw).astype(np.float64).T
    wabs = np.abs(reference(qtype, raw).astype(np.float64))
    _, d, _ = int8.quantize_numpy(x)
    act = 0.5 * (1 + 1e-5) / 254 * d.astype(np.float64) @ wabs.reshape(n, -1, 32).sum(-1).T
    rounding = (k // 32 + 4) * 2.0**-24 * (np.abs(x).astype(np.float64) @ wabs.T) * 4
    err = np.abs(w.matmul_refined(x).astype(np.float64) - exact)
    assert np.all(err <= act + rounding)
    plain = np.abs(w.matmul(x).astype(np.float64) - exact)
    assert np.median(err) * 100 < np.median(plain)


def test_float_arithmetic_and_formats_without_an_integer_path_fall_back_to_matmul():
    for w in (_w(QType.Q8_0, 40, 64, arithmetic="float"), _w(QType.F16, 40, 64)):
        assert not w.integer
        x = _x(2, 64, seed=5)
        assert_bits_equal(w.matmul_refined(x), w.matmul(x))


def test_refined_rows_in_slices_equal_one_pass(monkeypatch):
    """The refinement runs over slices of rows (bounded scratch): slice size changes no bit."""
    w = _w(QType.Q8_0, 50, 64)
    x = _x(11, 64, seed=6)
    whole = w.matmul_refined(x)
    monkeypatch.setattr(QuantWeight, "REFINE_ROWS", 3)
    assert_bits_equal(w.matmul_refined(x), whole)


@pytest.mark.parametrize("x", [np.zeros((2, 63), np.float32), np.zeros(64, np.float32),
                               np.zeros((2, 64), np.float64), [[0.0] * 64]])
def test_refined_rejects_bad_x(x):
    with pytest.raises(DimensionError, match="head: x must be"):
        _w(QType.Q8_0, 40, 64).matmul_refined(x)
