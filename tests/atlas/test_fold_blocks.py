"""The fold's register-blocked sums (fold_blocks.py) against plain float32 NumPy loops, bit for
bit: every output element is the same fused multiply-adds in the same order, so a blocked page
is the loops' page exactly, for every storage format, group count, offset and stride. The
loops' fused multiply-add is `fma32_numpy`, held here to exact rational arithmetic, and the
kernels' scalar `fma32` to it; the page's maximum (`max_run`) and weight sum (`sum_run`) to
NumPy's maximum and to the sum's twin."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from numba import njit

from cfr_atlas.atlas import fold
from cfr_atlas.atlas import fold_blocks as fb
from cfr_atlas.atlas.storage import StorageDtype, _f16_soft, format_of, round_rows, widen
from cfr_atlas.ops.activations import exp32, exp32_numpy

# fold's own dispatchers (up to GROUPS score groups, VALUE_GROUPS value groups a call); the
# test kernels are compiled without numba's disk cache, which would keep a stale entry after an
# edit of fold_blocks.py (the cache renews an entry only when its own file changes)
_scores = njit(fold._score_blocks.py_func)


@njit
def _values(v, j0, n, p, acc, e0, e_end, fmt):
    fold._value_blocks(v[:, e0:], j0, n, p, acc[:, e0:], e_end, fmt)


def _stored(rng, shape, dtype):
    return round_rows(rng.uniform(-3, 3, shape).astype(np.float32), dtype)


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7])
def test_score_blocks_are_the_plain_loop(dtype, groups):
    rng = np.random.default_rng(groups)
    D, P = 64, 16 * fb.KEYS + 40
    k = _stored(rng, (D, P), dtype)  # a K^T page
    q_wide = rng.standard_normal((groups, 2 * D)).astype(np.float32)
    q = q_wide[:, ::2]  # strided query rows: the block reads q through its strides
    kw = widen(k, dtype)
    # block counts around score_width's passes (1-8 blocks a pass) and their remainders
    for j0, n_blocks in ((0, 5), (3, 4), (17, 3), (64, 1), (5, 0), (0, 16), (1, 15), (7, 12),
                         (40, 9), (2, 8), (0, 7), (9, 6), (0, 2)):
        s = np.full((groups, P), -7.0, dtype=np.float32)
        _scores(k, j0, n_blocks, q, s, format_of(dtype))
        want = np.full((groups, P), -7.0, dtype=np.float32)
        n = n_blocks * fb.KEYS
        for g in range(groups):
            acc = np.zeros(n, dtype=np.float32)
            for e in range(D):  # in order, one float32 rounding per fused multiply-add
                acc = fb.fma32_numpy(q[g, e], kw[e, j0:j0 + n], acc)
            want[g, :n] = acc
        assert np.array_equal(s.view(np.uint32), want.view(np.uint32)), (j0, n_blocks)
    s = np.full((groups, P), -7.0, dtype=np.float32)
    _scores(k, 0, -1, q, s, format_of(dtype))  # a negative count: nothing read or written
    assert (s == -7.0).all()


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("groups", [1, 2, 3, 4, 7])
def test_value_blocks_are_the_plain_loop(dtype, groups):
    rng = np.random.default_rng(10 + groups)
    P, D = 50, 4 * fb.DIMS
    v = _stored(rng, (P, D), dtype)  # a V page
    vw = widen(v, dtype)
    p_wide = rng.random((groups, 2 * P)).astype(np.float32)
    p = p_wide[:, 1::2]  # strided weights
    # one block of DIMS dims, two (one 64-dim call on AVX-512), three (a 64-dim call and a
    # 32-dim one), from several first dims
    for j0, n, e0, dims in ((0, P, 0, 1), (7, 30, fb.DIMS, 1), (3, 1, 0, 1), (0, 0, fb.DIMS, 1),
                            (0, P, 0, 2), (11, 37, fb.DIMS, 2), (2, 48, fb.DIMS, 3),
                            (0, 1, 0, 4), (5, 45, 0, 3)):
        start = rng.standard_normal((groups, D)).astype(np.float32)
        acc = start.copy()
        _values(v, j0, n, p, acc, e0, dims * fb.DIMS, format_of(dtype))
        want = start.copy()
        cols = slice(e0, e0 + dims * fb.DIMS)
        for g in range(groups):
            a = want[g, cols].copy()
            for j in range(n):  # keys in order
                a = fb.fma32_numpy(p[g, j], vw[j0 + j, cols], a)
            want[g, cols] = a
        assert np.array_equal(acc.view(np.uint32), want.view(np.uint32)), (j0, n, e0, dims)


def _fma_exact(a, b, c) -> np.float32:
    """float32(a * b + c) rounded once, to nearest even, from exact rationals."""
    x = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    if abs(x) >= 2**128 - 2**103:  # past the largest float32 by half an ulp or more
        return np.float32(np.inf if x > 0 else -np.inf)
    lo = np.float32(float(x))  # float(x) rounds once to float64; find the float32 neighbours
    below = lo if Fraction(float(lo)) <= x else np.nextafter(lo, np.float32(-np.inf))
    above = np.nextafter(below, np.float32(np.inf))
    d_lo, d_hi = x - Fraction(float(below)), Fraction(float(above)) - x
    if d_lo != d_hi:
        return below if d_lo < d_hi else above
    return below if (int(below.view(np.uint32)) & 1) == 0 else above


# a * b on a float32 midpoint (1 + 2**-11 + 2**-24), c far below float64's ulp there: rounding
# the float64 sum to float32 would tie to even, the fused result is on c's side
_TIES = [(1 + 2.0**-12, 1 + 2.0**-12, 2.0**-80), (1 + 2.0**-12, 1 + 2.0**-12, -(2.0**-80)),
         (-(1 + 2.0**-12), 1 + 2.0**-12, 2.0**-80), (3.0, 1 / 3, -1.0), (0.0, -1.0, 0.0),
         (2.0**-70, 2.0**-70, 2.0**-149), (1e30, 1e30, 1.0)]


@njit
def _fma_all(a, b, c, out):
    for i in range(a.size):
        out[i] = fb.fma32(a[i], b[i], c[i])


def test_fma32_is_the_exactly_rounded_fused_multiply_add():
    rng = np.random.default_rng(3)
    n = 4000
    a = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    b = (rng.standard_normal(n) * np.exp2(rng.integers(-20, 20, n))).astype(np.float32)
    c = (-(a.astype(np.float64) * b) * (1 + rng.standard_normal(n) * 2.0**-20)).astype(np.float32)
    c[::3] = rng.standard_normal(n)[::3].astype(np.float32)  # cancellation and plain sums
    ties = np.array(_TIES, dtype=np.float32)
    a, b, c = (np.concatenate([x, ties[:, i]]) for i, x in enumerate((a, b, c)))
    emulated = fb.fma32_numpy(a, b, c)
    sample = list(range(0, n, 7)) + list(range(n, a.size))
    exact = np.array([_fma_exact(a[i], b[i], c[i]) for i in sample], dtype=np.float32)
    assert np.array_equal(emulated[sample].view(np.uint32), exact.view(np.uint32))
    with np.errstate(over="ignore"):  # the double rounding the ties hit
        naive = (a.astype(np.float64) * b + c).astype(np.float32)
    assert not np.array_equal(naive[n:n + 2], emulated[n:n + 2])
    kernel = np.empty_like(a)
    _fma_all(a, b, c, kernel)
    assert np.array_equal(kernel.view(np.uint32), emulated.view(np.uint32))


@njit
def _max_of(s, n):
    return fb.max_run(s, n)


@njit
def _sum_of(p, n):
    return fb.sum_run(p, n)


def test_max_run_and_sum_run_on_every_length_and_offset():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(300) * 5).astype(np.float32)
    for off in (0, 1, 5):
        for n in range(1, 120):
            row = x[off:off + n]
            assert _max_of(row, n) == row.max(), (off, n)
            got, want = _sum_of(row, n), fb.sum_run_numpy(row, n)
            assert np.float64(got).view(np.uint64) == np.float64(want).view(np.uint64), (off, n)
            assert abs(got - row.astype(np.float64).sum()) <= 1e-12 * np.abs(row).sum()
    assert _sum_of(x, 0) == 0.0


@njit
def _soft_all(bits, out):
    for i in range(0, bits.size, fb.KEYS):
        fb.widen_soft16(bits, i, out)


@njit
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


def _slabs(rng, dtype, n_slots, D, P, strided):
    """K^T (n_slots, D, P) and V (n_slots, P, D) pages; strided: views with a column stride of
    two elements, which the fold folds with its plain loops (the blocks need unit strides)."""
    k = _stored(rng, (n_slots, D, P), dtype)
    v = _stored(rng, (n_slots, P, D), dtype)
    if not strided:
        return k, v
    k2 = np.zeros((n_slots, D, 2 * P), dtype=k.dtype)
    v2 = np.zeros((n_slots, P, 2 * D), dtype=v.dtype)
    k2[:, :, ::2], v2[:, :, ::2] = k, v
    return k2[:, :, ::2], v2[:, :, ::2]


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("D, P, G, window", [(64, 40, 3, 0), (80, 37, 7, 50), (32, 16, 4, 0),
                                             (96, 33, 5, 20)])
def test_the_fold_with_blocks_is_the_fold_without_them_bit_for_bit(dtype, D, P, G, window):
    """The same pages folded through the blocks (unit-stride slabs) and through the plain loops
    (the same values in strided views): every state entry and flag equal. Mapped pages stay
    unit-stride in both, so the checked path (K^T's checksum before the blocked scores) runs
    beside hot and scratch pages folded both ways."""
    rng = np.random.default_rng(D + P + G)
    T, H, S, context, split = 3, 2, 6, 150, 2
    q = rng.standard_normal((T, H, G, D)).astype(np.float32)
    pages = {}
    for strided in (False, True):
        r = np.random.default_rng(7)  # the same values both ways
        pages[strided] = (_slabs(r, dtype, S, D, P, strided), _slabs(r, dtype, S, D, P, strided))
    r = np.random.default_rng(8)
    k_map, v_map = _slabs(r, dtype, S, D, P, False)
    from cfr_atlas.atlas.page_sum import page_checksum_numpy
    n_pages = -(-context // P)
    lo = max(0, (context - T - window + 1) // P) if window else 0
    n_pg = n_pages - lo
    src = rng.integers(0, 3, (H, n_pg)).astype(np.int64)
    slot = rng.integers(0, S, (H, n_pg)).astype(np.int64)
    expect = np.array([[page_checksum_numpy(k_map[sl], v_map[sl]) for sl in row] for row in slot],
                      dtype=np.uint32)
    expect[1, -1] ^= 1  # one mapped page whose checksum does not match (if it is mapped)
    results = []
    for strided in (False, True):
        (k_hot, v_hot), (k_scr, v_scr) = pages[strided]
        bad = np.zeros((H, n_pg), dtype=np.uint8)
        state = (np.full((T, H, -(-n_pages // split), G), -np.inf),
                 np.zeros((T, H, -(-n_pages // split), G)),
                 np.zeros((T, H, -(-n_pages // split), G, D)))
        fold.fold_pages(q, np.arange(context - T, context, dtype=np.int64),
                        (k_hot, v_hot, k_scr, v_scr, k_map, v_map),
                        (src, slot, expect, bad), (lo, context, split, 0, H * n_pg),
                        (np.float32(D ** -0.5), np.float32(0.0),
                         np.zeros((H, G), dtype=np.float32), window, format_of(dtype)), state)
        results.append((state, bad))
    (s1, bad1), (s2, bad2) = results
    for a, b in zip(s1, s2, strict=True):
        assert np.array_equal(a.view(np.uint64), b.view(np.uint64))
    assert np.array_equal(bad1, bad2)
    assert bad1[1, -1] == (src[1, -1] == fold.SRC_MAP)


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("context, T, window", [(41, 1, 0), (75, 4, 0), (200, 3, 0),
                                                (150, 2, 29)])
def test_a_last_partial_block_never_reads_into_the_result_what_lies_past_its_keys(
        dtype, context, T, window):
    """A page's last partial block of keys runs as a whole block where the page's columns hold
    it (`_fold_item`): its lanes past the query's keys read columns that hold no key of that
    query (later tokens, or none yet). Whatever those columns hold (zeros, NaN, infinities,
    large ones) the state is the same bits, and the same as the plain loops' (a strided page,
    no blocks)."""
    D, P, G, H, split = 64, 64, 3, 2, 2
    rng = np.random.default_rng(context + T)
    n_pages = -(-context // P)
    q = rng.standard_normal((T, H, G, D)).astype(np.float32)
    k, v = _slabs(np.random.default_rng(3), dtype, H * n_pages, D, P, False)
    lo = max(0, (context - T - window + 1) // P) if window else 0
    n_pg = n_pages - lo
    slot = (np.arange(H * n_pages).reshape(H, n_pages)[:, lo:]).astype(np.int64)
    qpos = np.arange(context - T, context, dtype=np.int64)
    # +-100: scores far above the keys' for any query (one sign or the other), finite in
    # every storage format, so a lane past the keys that reached the maximum or the sums
    # would change the state (NaN and infinities could hide behind maxnum)
    fill = {"zero": 0.0, "nan": np.nan, "inf": np.inf, "+100": 100.0, "-100": -100.0,
            "big": 3e38}
    results = []
    for value in [*fill.values(), None]:  # None: the strided views
        kk, vv = k.copy(), v.copy()
        last = slot[:, -1]
        tail = context - (n_pages - 1) * P  # keys held by the last page
        if value is not None:
            pad = round_rows(np.full((1,), value, dtype=np.float32), dtype)[0]
            kk[last, :, tail:] = pad
            vv[last, tail:, :] = pad
        else:  # the same keys in strided views: the plain loops
            k2 = np.zeros((*kk.shape[:2], 2 * P), dtype=kk.dtype)
            v2 = np.zeros((kk.shape[0], P, 2 * D), dtype=vv.dtype)
            k2[:, :, ::2], v2[:, :, ::2] = kk, vv
            kk, vv = k2[:, :, ::2], v2[:, :, ::2]
        empty_k, empty_v = kk[:0], vv[:0]
        n_part = -(-n_pages // split)
        state = (np.full((T, H, n_part, G), -np.inf), np.zeros((T, H, n_part, G)),
                 np.zeros((T, H, n_part, G, D)))
        bad = np.zeros((H, n_pg), dtype=np.uint8)
        fold.fold_pages(q, qpos, (kk, vv, empty_k, empty_v, empty_k, empty_v),
                        (np.zeros((H, n_pg), dtype=np.int64), slot,
                         np.zeros((H, n_pg), dtype=np.uint32), bad),
                        (lo, context, split, 0, H * n_pg),
                        (np.float32(D ** -0.5), np.float32(0.0),
                         np.zeros((H, G), dtype=np.float32), window, format_of(dtype)), state)
        assert np.isfinite(state[2]).all() and not bad.any()
        results.append(state)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert np.array_equal(a.view(np.uint64), b.view(np.uint64))


@njit
def _exp_all(s, m, p):
    done = fb.exp_run(s, m, p, s.size)
    for j in range(done, s.size):
        p[j] = exp32(s[j] - m)
    return done


def test_exp_run_is_exp32_lane_for_lane():
    """The fold's vector weights against exp32's NumPy twin, bit for bit: random scores around
    the running maximum, the clamps' edges (88, -87 and their neighbours), rint's ties, NaN,
    infinities, signed zeros, subnormals; lengths that leave a scalar tail of every size."""
    rng = np.random.default_rng(3)
    edges = np.array([88.0, -87.0, np.nextafter(np.float32(88.0), np.float32(0)),
                      np.nextafter(np.float32(-87.0), np.float32(0)), 88.5, -87.5, 0.0, -0.0,
                      np.nan, np.inf, -np.inf, 1e-45, -1e-45, 0.3465736, -0.3465736,
                      0.34657359 * 3, 1e30, -1e30], dtype=np.float32)
    x = np.concatenate([edges, rng.standard_normal(300).astype(np.float32) * 30,
                        -rng.random(300).astype(np.float32) * 100,
                        np.log(2) * (rng.integers(-130, 130, 100) + 0.5)]).astype(np.float32)
    for m in (np.float32(0.0), np.float32(2.5), np.float32(-80.0), np.float32(np.inf)):
        for n in (0, 1, 15, 16, 17, 31, 32, 100, x.size):
            s = x[:n].copy()
            p = np.full(n, -7.0, dtype=np.float32)
            done = _exp_all(s, m, p)
            assert done == n - n % fb.KEYS
            with np.errstate(invalid="ignore", over="ignore"):
                want = exp32_numpy(s - m)
            assert np.array_equal(p.view(np.uint32), want.view(np.uint32)), (m, n)
    with pytest.raises(Exception, match="(?i)typ"):  # float64 lanes are not float32 ones
        _exp_all(x.astype(np.float64), np.float32(0.0), np.zeros(x.size))
    with pytest.raises(Exception, match="(?i)typ"):  # nor are strided ones
        _exp_all(x[::2], np.float32(0.0), np.zeros(x[::2].size, dtype=np.float32))
