"""The parallel fold and merge kernels against the serial ones, bitwise, above the threshold.

`fold_pages` / `merge_partitions` pick `_fold_parallel` / `_merge_parallel` once a call reaches
`fold.PARALLEL_MIN_PAIRS` (query x key pairs, resp. state entries). Both kernels inline the same
work item, so the results must be bitwise equal, and equal for 1 and 2 numba threads. Each test
counts the calls of the parallel kernels (a wrapper around the real ones), so a test whose shape
misses the threshold fails instead of passing vacuously.

Two ways over the threshold: the fold_twins cases (small shapes, every storage dtype, window,
softcap, ALiBi, sinks) with the threshold lowered to 1, and one natural shape above the real
threshold (no patching of it).
"""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cfr_atlas.atlas import fold
from cfr_atlas.atlas.storage import StorageDtype, format_of, round_rows

CASES = {
    "plain": {}, "window": dict(window=7), "softcap": dict(softcap=3.0),
    "alibi+sinks": dict(alibi=True, sinks=True), "one page": dict(context=4, T=2),
    "all": dict(window=12, softcap=2.0, alibi=True, sinks=True, split=3),
}  # fmt: skip
# above the real threshold: T * G * (H * pages) * P = 8 * 4 * 32 * 16 = 16,384 pairs >= 8,192;
# merge states T * H * parts * G * D = 8 * 2 * 8 * 4 * 64 = 32,768 >= 8,192
NATURAL = dict(T=8, H=2, G=4, D=64, P=16, context=256, split=2, alibi=True, sinks=True)


def _problem(rng, dtype, *, T=3, H=2, G=2, D=12, P=5, context=33, split=2, window=0,
             softcap=0.0, alibi=False, sinks=False):
    """(fold args without the state, state shape, sinks) of a random walk over all pages."""
    S, C = 9, 4
    q = rng.standard_normal((T, H, G, D)).astype(np.float32)
    k_hot, v_hot, k_scr, v_scr, k_map, v_map = (
        round_rows(rng.uniform(-2, 2, (n, P, D)).astype(np.float32), dtype)
        for n in (S, S, C, C, C, C))
    k_hot, k_scr, k_map = (np.ascontiguousarray(a.transpose(0, 2, 1))
                           for a in (k_hot, k_scr, k_map))
    n_pages = -(-context // P)
    src = rng.integers(0, 3, (H, n_pages)).astype(np.int64)
    slot = np.where(src == fold.SRC_HOT, rng.integers(0, S, (H, n_pages)),
                    rng.integers(0, C, (H, n_pages))).astype(np.int64)
    expect = np.zeros((H, n_pages), dtype=np.uint32)  # wrong for most mapped pages: flags
    slopes = rng.uniform(0, 0.5, (H, G)) if alibi else np.zeros((H, G))
    sink = rng.uniform(-2, 2, (H, G)) if sinks else np.full((H, G), np.nan)
    args = (q, np.arange(context - T, context, dtype=np.int64),
            (k_hot, v_hot, k_scr, v_scr, k_map, v_map),
            (src, slot, expect, np.zeros((H, n_pages), dtype=np.uint8)),
            (0, context, split, 0, H * n_pages),
            (np.float32(1 / math.sqrt(D)), np.float32(softcap), slopes.astype(np.float32),
             window, format_of(dtype)))
    return args, (T, H, -(-n_pages // split), G, D), sink.astype(np.float32)


def _state(T, H, n_part, G, D):
    return (np.full((T, H, n_part, G), -np.inf), np.zeros((T, H, n_part, G)),
            np.zeros((T, H, n_part, G, D)))


@pytest.fixture
def parallel_calls(monkeypatch):
    """Counts calls of the real parallel kernels made through fold_pages / merge_partitions."""
    calls = {"fold": 0, "merge": 0}
    real_fold, real_merge = fold._fold_parallel, fold._merge_parallel

    def counted_fold(*a):
        calls["fold"] += 1
        return real_fold(*a)

    def counted_merge(*a):
        calls["merge"] += 1
        return real_merge(*a)

    monkeypatch.setattr(fold, "_fold_parallel", counted_fold)
    monkeypatch.setattr(fold, "_merge_parallel", counted_merge)
    return calls


def _serial(args, shape, sinks):
    """The serial kernels called directly: the baseline whatever the threshold says."""
    m, l, acc = _state(*shape)
    args = _fresh_flags(args)
    fold._fold_serial(*args, (m, l, acc), fold._n_items(args[0], args[3], args[4]))
    out = np.empty(shape[:2] + shape[3:], dtype=np.float32)
    fold._merge_serial(m, l, acc, sinks, out)
    return m, l, acc, out, args[3][3]


def _fresh_flags(args):
    """The same problem with its own `bad` flags (each run's are compared, not shared)."""
    src, slot, expect, bad = args[3]
    return args[:3] + ((src, slot, expect, np.zeros_like(bad)),) + args[4:]


def _dispatched(args, shape, sinks):
    """Through the public entry points, which choose the kernel by size."""
    m, l, acc = _state(*shape)
    args = _fresh_flags(args)
    fold.fold_pages(*args, (m, l, acc))
    out = np.empty(shape[:2] + shape[3:], dtype=np.float32)
    fold.merge_partitions(m, l, acc, sinks, out)
    return m, l, acc, out, args[3][3]


def _assert_bitwise(a, b):
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y, equal_nan=True)


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
@pytest.mark.parametrize("case", CASES)
def test_forced_parallel_equals_serial(monkeypatch, parallel_calls, all_threads, dtype, case):
    monkeypatch.setattr(fold, "PARALLEL_MIN_PAIRS", 1)
    problem = _problem(np.random.default_rng(len(case)), dtype, **CASES[case])
    _assert_bitwise(_dispatched(*problem), _serial(*problem))
    assert parallel_calls == {"fold": 1, "merge": 1}


@pytest.mark.parametrize("dtype", list(StorageDtype), ids=lambda d: d.value)
def test_natural_shape_above_threshold_parallel_equals_serial(parallel_calls, all_threads, dtype):
    problem = _problem(np.random.default_rng(7), dtype, **NATURAL)
    _assert_bitwise(_dispatched(*problem), _serial(*problem))
    assert parallel_calls == {"fold": 1, "merge": 1}


def test_one_and_two_threads_agree_above_threshold(parallel_calls, all_threads):
    if all_threads < 2:
        pytest.skip(f"numba has {all_threads} thread here; the comparison needs 2")
    problem = _problem(np.random.default_rng(8), StorageDtype.FLOAT32, **NATURAL)
    results = []
    for threads in (1, 2):
        numba.set_num_threads(threads)
        results.append(_dispatched(*problem))
    _assert_bitwise(*results)
    assert parallel_calls == {"fold": 2, "merge": 2}
    _assert_bitwise(results[0], _serial(*problem))


def test_below_threshold_stays_serial(parallel_calls):
    """The counter itself works: a small call does not take the parallel kernels."""
    problem = _problem(np.random.default_rng(9), StorageDtype.FLOAT32)
    _dispatched(*problem)
    assert parallel_calls == {"fold": 0, "merge": 0}


def test_the_compiled_plan_is_the_rules():
    """fold.plan_sizes (what the batched decode walk plans with, compiled) equals the three
    rules the general path reads (_walk_items, _fold_in_parallel, _merge_in_parallel), over
    sizes around every threshold, at the default threshold and another."""
    from cfr_atlas.atlas import fold

    for min_pairs in (fold.PARALLEL_MIN_PAIRS, 300):
        for n_tok in (1, 3):
            for n_head, n_grp, dv in ((1, 1, 8), (3, 3, 64), (8, 4, 128)):
                for n_pg in (1, 2, 5, 17):
                    for lo in (0, 1, 6):
                        for split in (1, 4):
                            for page_tokens in (16, 256):
                                n_part = (lo + n_pg + split - 1) // split
                                want = (fold._walk_items(n_tok, n_head, n_pg, lo, split),
                                        n_tok * n_grp * n_head * n_pg * page_tokens
                                        >= min_pairs,
                                        n_tok * n_head * n_part * n_grp * dv >= min_pairs)
                                args = (n_tok, n_head, n_grp, n_pg, lo, split, page_tokens,
                                        dv, min_pairs)
                                assert fold.plan_sizes(*args) == want, args
                                assert fold._plan_of(*args) == want, args
    rules = (fold._fold_in_parallel(2, 3, 4, 256), fold._merge_in_parallel((2, 3, 4, 3, 64)))
    saved = fold.PARALLEL_MIN_PAIRS
    assert rules == (2 * 3 * 4 * 256 >= saved, 2 * 3 * 4 * 3 * 64 >= saved)


# --- the parallel fold's lanes ---------------------------------------------------------------


@given(st.lists(st.integers(0, 5000), min_size=1, max_size=60), st.integers(1, 9))
@settings(max_examples=150, deadline=None)
def test_balanced_runs_cut_the_items_in_order_and_evenly(costs, n_lanes):
    """Runs cover the items in order, each exactly once; each cut is the item boundary
    nearest to its share of the total (the lower one on a tie), so no run exceeds an even share
    by more than one item's cost."""
    c = np.array(costs, dtype=np.int64)
    bounds = fold.balanced_runs(c, n_lanes)
    assert bounds.shape == (n_lanes + 1,) and bounds[0] == 0 and bounds[-1] == len(c)
    assert np.all(np.diff(bounds) >= 0)
    prefix = np.concatenate([[0], np.cumsum(c)])
    for r in range(1, n_lanes):
        target = prefix[-1] * r / n_lanes
        dist = np.abs(prefix - target)
        nearest = int(np.flatnonzero(dist == dist.min())[0])  # the lower one on a tie
        assert bounds[r] == max(nearest, bounds[r - 1]), (r, target, bounds)
    loads = [int(c[bounds[r]:bounds[r + 1]].sum()) for r in range(n_lanes)]
    assert max(loads) <= c.sum() / n_lanes + c.max()


def test_balanced_runs_even_out_a_decode_walk():
    """The decode walk that prange's equal counts split 17 : 10 pages (three heads, partitions
    of 4, 4 and 1 pages, two threads) is cut 13 : 14; even costs into even halves."""
    assert fold.balanced_runs(np.array([4, 4, 1] * 3, dtype=np.int64), 2).tolist() == [0, 4, 9]
    assert fold.balanced_runs(np.full(18, 4, dtype=np.int64), 2).tolist() == [0, 9, 18]


def _keys_by_item(q, qpos, n_pg, span, window, P):
    """An independent count: for every (query t, head h, page), the keys it reads, summed
    into the item (h, partition, t) `_fold_item` folds that page in."""
    lo, context, split, a, b = span
    n_tok, n_head = q.shape[:2]
    p0 = lo // split
    n_parts = (lo + n_pg - 1) // split - p0 + 1
    keys = np.zeros(n_head * n_parts * n_tok, dtype=np.int64)
    for h in range(n_head):
        for i in range(n_pg):
            if not a <= h * n_pg + i < b:
                continue
            gp = lo + i
            for t, pos in enumerate(qpos):
                low = pos - window + 1 if window > 0 else 0
                first, last = gp * P, min((gp + 1) * P, context) - 1
                n = max(0, min(last, pos) - max(first, low) + 1)
                keys[(h * n_parts + gp // split - p0) * n_tok + t] += n
    return keys


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("lo, cut", [(0, None), (2, None), (0, (3, 9)), (1, (1, 5))])
def test_item_keys_count_each_items_pairs(case, lo, cut):
    """`_item_keys` (the cost the runs are cut by) equals, item by item, the (query, key)
    pairs of its pages that the causal (and windowed) attention reads, for walks from page 0
    or a later page and for a slice a..b of the walk's pages."""
    args, _, _ = _problem(np.random.default_rng(3), StorageDtype.FLOAT32, **CASES[case])
    q, qpos, slabs, walk, (_, context, split, _, _), score = args
    P = slabs[1].shape[1]
    n_pg = -(-context // P) - lo
    if n_pg < 1:
        pytest.skip("the walk has no page after lo")
    walk = tuple(x[:, lo:] for x in walk)
    a, b = (0, q.shape[1] * n_pg) if cut is None else cut
    span = (lo, context, split, a, min(b, q.shape[1] * n_pg))
    items = fold._n_items(q, walk, span)
    got = [fold._item_keys(w, q, qpos, walk, span, score[3], P) for w in range(items)]
    assert got == _keys_by_item(q, qpos, n_pg, span, score[3], P).tolist()


@pytest.mark.parametrize("lanes", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("case", ["plain", "all"])
def test_any_lane_count_folds_the_same_bits(all_threads, case, lanes):
    """The parallel fold with any number of lanes, more or fewer than threads or items, equals
    the serial fold bitwise."""
    args, shape, sinks = _problem(np.random.default_rng(11), StorageDtype.FLOAT16,
                                  **CASES[case])
    args = _fresh_flags(args)
    state = _state(*shape)
    fold._fold_parallel(*args, state, fold._n_items(args[0], args[3], args[4]), lanes)
    m, l, acc, _, bad = _serial(args, shape, sinks)
    _assert_bitwise(state + (args[3][3],), (m, l, acc, bad))
