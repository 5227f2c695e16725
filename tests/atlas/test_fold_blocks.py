"""The fold's register-blocked sums (fold_blocks.py) against plain float32 NumPy loops, bit for
bit: every output element is the same products and sums in the same order, so a blocked page
is the loops' page exactly, for every storage format, group count, offset and stride."""

from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from cfr_atlas.atlas import fold_blocks as fb
from cfr_atlas.atlas.storage import StorageDtype, _f16_soft, format_of, round_rows, widen


@njit(cache=True)
def _scores(k, j0, n_blocks, q, s, fmt):
    n_grp = q.shape[0]
    for g0 in range(0, n_grp, fb.GROUPS):
        left = n_grp - g0
        if left >= 4:
            fb.score_block(k, j0, n_blocks, q, g0, s, 4, fmt)
        elif left == 3:
            fb.score_block(k, j0, n_blocks, q, g0, s, 3, fmt)
        elif left == 2:
            fb.score_block(k, j0, n_blocks, q, g0, s, 2, fmt)
        else:
            fb.score_block(k, j0, n_blocks, q, g0, s, 1, fmt)


@njit(cache=True)
def _values(v, j0, n, p, acc, e0, fmt):
    n_grp = acc.shape[0]
    for g0 in range(0, n_grp, fb.GROUPS):
        left = n_grp - g0
        if left >= 4:
            fb.values_block(v, j0, n, p, g0, acc, e0, 4, fmt)
        elif left == 3:
            fb.values_block(v, j0, n, p, g0, acc, e0, 3, fmt)
        elif left == 2:
            fb.values_block(v, j0, n, p, g0, acc, e0, 2, fmt)
        else:
            fb.values_block(v, j0, n, p, g0, acc, e0, 1, fmt)


def _stored(rng, shape, dtype):
    return round_rows(rng.uniform(-3, 3, shape).astype(np.float32), dtype)


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7])
def test_score_blocks_are_the_plain_loop(dtype, groups):
    rng = np.random.default_rng(groups)
    D, P = 64, 80
    k = _stored(rng, (D, P), dtype)  # a K^T page
    q_wide = rng.standard_normal((groups, 2 * D)).astype(np.float32)
    q = q_wide[:, ::2]  # strided query rows: the block reads q through its strides
    kw = widen(k, dtype)
    for j0, n_blocks in ((0, 5), (3, 4), (17, 3), (64, 1), (5, 0)):
        s = np.full((groups, P), -7.0, dtype=np.float32)
        _scores(k, j0, n_blocks, q, s, format_of(dtype))
        want = np.full((groups, P), -7.0, dtype=np.float32)
        n = n_blocks * fb.KEYS
        for g in range(groups):
            acc = np.zeros(n, dtype=np.float32)
            for e in range(D):  # in order, one float32 rounding per product and per sum
                acc = acc + q[g, e] * kw[e, j0:j0 + n]
            want[g, :n] = acc
        assert np.array_equal(s.view(np.uint32), want.view(np.uint32)), (j0, n_blocks)


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7])
def test_value_blocks_are_the_plain_loop(dtype, groups):
    rng = np.random.default_rng(10 + groups)
    P, D = 50, 2 * fb.DIMS
    v = _stored(rng, (P, D), dtype)  # a V page
    vw = widen(v, dtype)
    p_wide = rng.random((groups, 2 * P)).astype(np.float32)
    p = p_wide[:, 1::2]  # strided weights
    for j0, n, e0 in ((0, P, 0), (7, 30, fb.DIMS), (3, 1, 0), (0, 0, fb.DIMS)):
        start = rng.standard_normal((groups, D)).astype(np.float32)
        acc = start.copy()
        _values(v, j0, n, p, acc, e0, format_of(dtype))
        want = start.copy()
        cols = slice(e0, e0 + fb.DIMS)
        for g in range(groups):
            a = want[g, cols].copy()
            for j in range(n):  # keys in order
                a = a + p[g, j] * vw[j0 + j, cols]
            want[g, cols] = a
        assert np.array_equal(acc.view(np.uint32), want.view(np.uint32)), (j0, n, e0)


@njit(cache=True)
def _soft_all(bits, out):
    for i in range(0, bits.size, fb.KEYS):
        fb.widen_soft16(bits, i, out)


@njit(cache=True)
def _scalar_all(bits, out):
    for i in range(bits.size):
        out[i] = _f16_soft(bits[i])


def test_the_vector_float16_rule_without_f16c_is_the_scalar_one_on_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    vec, scalar = (np.empty(bits.size, dtype=np.float32) for _ in range(2))
    _soft_all(bits, vec)
    _scalar_all(bits, scalar)
    assert np.array_equal(vec.view(np.uint32), scalar.view(np.uint32))
    finite = (bits & 0x7C00) != 0x7C00
    assert np.array_equal(vec[finite], bits[finite].view(np.float16).astype(np.float32))
