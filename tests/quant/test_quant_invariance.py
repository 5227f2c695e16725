"""Batch invariance, bit for bit: matmul(X)[t] == matvec(X[t]) == matmul(X[a:b])[t - a] for every
format, any T, any chunk split, any thread count, and whatever `out` held before the call."""

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_data import BLOCK_FORMATS, assert_bits_equal, cols, edge_raw, quantized

from cfr_atlas.quant import QType, QuantWeight

# Block formats at N = 100 (not a whole number of 16-row tiles) and 4 blocks a row; floats at
# K = 72 (padded to 96).
SHAPES = {qt: (100, cols(qt, 128)) if qt in BLOCK_FORMATS else (100, 72) for qt in QType}


@pytest.fixture(scope="module")
def weights():
    return {qt: QuantWeight.from_raw(qt.name, qt, quantized(qt, *shape, seed=qt.value), shape)
            for qt, shape in SHAPES.items()}


def _x(t: int, k: int, seed: int) -> np.ndarray:
    """Tokens with a wide dynamic range, exact zeros and negative zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)) * 2.0 ** rng.integers(-12, 12, size=(t, 1))
    x[rng.random((t, k)) < 0.05] = 0.0
    x[rng.random((t, k)) < 0.05] = -0.0
    return x.astype(np.float32)


def _check(w: QuantWeight, x: np.ndarray, cuts: list[int], rows=None) -> None:
    """matmul(x) against matvec on `rows` (default all) and against matmul over the chunks."""
    y = w.matmul(x)
    for t in range(x.shape[0]) if rows is None else rows:
        assert_bits_equal(y[t], w.matvec(x[t]))
    bounds = [0, *cuts, x.shape[0]]
    chunks = [w.matmul(x[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert_bits_equal(np.concatenate(chunks), y)


@pytest.mark.parametrize("qtype", list(QType))
@pytest.mark.parametrize("t", [1, 2, 3, 7, 64, 257])
def test_rows_equal_matvec_and_chunks(weights, qtype, t):
    w = weights[qtype]
    cuts = sorted({c for c in (1, 3, 4, 11, 64, 100) if c < t})
    rows = range(t) if t <= 64 else [*range(0, t, 5), t - 2, t - 1]  # chunks cover the rest
    _check(w, _x(t, w.shape[1], seed=t), cuts, rows)


@pytest.mark.parametrize("qtype", list(BLOCK_FORMATS))
def test_edge_blocks_are_invariant(qtype):
    k = cols(qtype, 96)
    w = QuantWeight.from_raw("w", qtype, edge_raw(qtype, 40, k, seed=6), (40, k))
    _check(w, _x(9, k, seed=7), [1, 4, 5])


@pytest.mark.parametrize("qtype", list(QType))
def test_thread_count_and_out_contents_do_not_matter(weights, qtype):
    w = weights[qtype]
    x = _x(37, w.shape[1], seed=11)
    y = w.matmul(x)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        garbage = np.full((37, w.shape[0]), np.nan, dtype=np.float32)
        assert_bits_equal(w.matmul(x, out=garbage), y)
    finally:
        numba.set_num_threads(before)


@st.composite
def _cases(draw):
    qtype = draw(st.sampled_from(list(QType)))
    n = draw(st.integers(1, 70))
    k = cols(qtype, draw(st.sampled_from([32, 64, 96]))) if qtype in BLOCK_FORMATS else draw(
        st.integers(1, 100))
    t = draw(st.integers(1, 40))
    cuts = sorted(set(draw(st.lists(st.integers(1, t - 1), max_size=5)))) if t > 1 else []
    rows = draw(st.lists(st.integers(0, t - 1), min_size=1, max_size=4))
    return qtype, n, k, t, cuts, rows, draw(st.integers(0, 2**31))


@settings(max_examples=150, deadline=None)
@given(_cases())
def test_invariance_property(case):
    qtype, n, k, t, cuts, rows, seed = case
    w = QuantWeight.from_raw("w", qtype, quantized(qtype, n, k, seed=seed), (n, k))
    _check(w, _x(t, k, seed=seed), cuts, rows)
