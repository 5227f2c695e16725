"""Exactness of the Atlas: any budget, policy, head layout, mask or storage dtype gives results
bitwise equal (`np.array_equal`) to an unbounded cache, and close to a float64 reference.

Baselines are always an unbounded Atlas with the same storage dtype and split; the float64
reference (atlas_reference.py) is computed from the rows rounded to that dtype.
"""

from __future__ import annotations

import numba
import numpy as np
import pytest
from atlas_reference import (
    CountingKv,
    error_bound,
    reference_attention,
    stored_rows,
    synthetic,
    unbounded,
)

from cfr_atlas import (
    LRU,
    Atlas,
    AtlasConfig,
    AttentionRequest,
    KeepAll,
    KeepRecent,
    KeepSinksAndRecent,
    NeverAdmit,
)
from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen

D, P = 16, 4
POLICIES = {
    "never": NeverAdmit(), "all": KeepAll(), "recent": KeepRecent(recent_tokens=2 * P),
    "sinks+recent": KeepSinksAndRecent(sink_tokens=P, recent_tokens=2 * P), "lru": LRU(),
}


def _query(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


def _budgeted(budget_pages: int, *, admit=True, storage_dtype="float32", **kw) -> Atlas:
    row_bytes = 2 * D * StorageDtype(storage_dtype).itemsize
    budget = budget_pages * P * row_bytes
    return Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget,
                             admit_regenerated_pages=admit, storage_dtype=storage_dtype, **kw))


def _sequence(atlas, base, syn, policy, contexts, rng, heads=((0, 0), (1, 2), (0, 1)), **opts):
    """Attend at growing contexts over several (layer, kv_head); assert every call bitwise."""
    for context in contexts:
        for layer, head in heads:
            req = AttentionRequest(layer, head, _query(rng, 3, D), context, **opts)
            got, want = atlas.attend(syn, req, policy), base.attend(syn, req)
            assert np.array_equal(got, want), (context, layer, head)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget_pages", [0, 1, 3, 10])
def test_every_budget_and_policy_equals_unbounded(policy, budget_pages):
    syn, rng = synthetic(D), np.random.default_rng(budget_pages)
    atlas, base = _budgeted(budget_pages), unbounded(P, D)
    _sequence(atlas, base, syn, POLICIES[policy], [1, 3, 4, 5, 9, 16, 23, 37], rng)
    assert atlas.cache.resident_bytes <= atlas.config.hot_cache_bytes


@pytest.mark.parametrize("admit", [False, True])
@pytest.mark.parametrize("scratch_pages", [1, 3, 8])
def test_scratch_size_and_admission_do_not_change_results(admit, scratch_pages):
    syn, rng = synthetic(D), np.random.default_rng(1)
    atlas = _budgeted(2, admit=admit, max_scratch_tokens=scratch_pages * P)
    _sequence(atlas, unbounded(P, D), syn, KeepRecent(P), [7, 21, 40], rng)


def test_thread_count_does_not_change_results():
    syn, rng = synthetic(D), np.random.default_rng(2)
    q = _query(rng, 5, 3, D)
    req = AttentionRequest(0, 1, q, 77, alibi_slope=0.1, sink=0.5)
    outs = []
    for threads in (1, numba.config.NUMBA_NUM_THREADS):
        numba.set_num_threads(threads)
        try:
            outs.append(Atlas(AtlasConfig(page_tokens=P, head_dim=D, split_pages=2)).attend(
                syn, req))
        finally:
            numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert np.array_equal(outs[0], outs[1])


@pytest.mark.parametrize("n_kv_heads,group", [(3, 1), (1, 4), (2, 3)], ids=["mha", "mqa", "gqa"])
def test_head_layouts(n_kv_heads, group):
    """MHA (group 1), MQA (one K/V head), GQA: budgeted == unbounded, each query head of a group
    equals the same query alone, and the float64 reference holds within its bound."""
    syn, rng = synthetic(D, n_kv_heads=n_kv_heads), np.random.default_rng(group)
    atlas, base, alone = _budgeted(2), unbounded(P, D), unbounded(P, D)
    scale = 1 / np.sqrt(D)
    for context in (6, 19):
        for head in range(n_kv_heads):
            q = _query(rng, group, D)
            got = atlas.attend(syn, AttentionRequest(1, head, q, context), KeepRecent(P))
            assert np.array_equal(got, base.attend(syn, AttentionRequest(1, head, q, context)))
            for g in range(group):
                one = alone.attend(syn, AttentionRequest(1, head, q[g], context))
                assert np.array_equal(got[g], one)
            K, V = syn.full(1, head, context)
            ref = reference_attention(q, K, V, context - 1, scale)
            assert np.abs(got - ref).max() <= error_bound(q, K, V, context - 1, scale)


@pytest.mark.parametrize("context", [1, 2, P - 1, P, P + 1, 2 * P - 1, 3 * P, 3 * P + 1])
def test_context_edges(context):
    """One token, a partial last page, exact multiples of the page."""
    syn, rng = synthetic(D), np.random.default_rng(context)
    q = _query(rng, 2, D)
    req = AttentionRequest(0, 0, q, context)
    got = _budgeted(1).attend(syn, req, KeepRecent(P))
    assert np.array_equal(got, unbounded(P, D).attend(syn, req))
    K, V = syn.full(0, 0, context)
    ref = reference_attention(q, K, V, context - 1, 1 / np.sqrt(D))
    assert np.abs(got - ref).max() <= error_bound(q, K, V, context - 1, 1 / np.sqrt(D))
    if context == 1:  # one key: attention returns its value row (weights are exactly 1)
        assert np.array_equal(got, np.broadcast_to(V[0], got.shape))


@pytest.mark.parametrize("window,tokens", [(1, 1), (5, 1), (8, 1), (9, 3), (100, 2)])
def test_window_skips_pages_wholly_outside(window, tokens):
    syn, rng = synthetic(D), np.random.default_rng(window)
    context = 40
    counting = CountingKv(syn)
    q = _query(rng, tokens, 2, D)
    req = AttentionRequest(1, 1, q, context, window=window)
    got = _budgeted(0).attend(counting, req, NeverAdmit())
    assert np.array_equal(got, unbounded(P, D).attend(syn, req))
    lowest = max(0, context - tokens - window + 1)  # lowest key any query of the chunk sees
    first = lowest // P
    assert sorted(k.start_token for k in counting.calls) == list(range(first * P, context, P))
    assert set(counting.calls.values()) == {1}
    K, V = syn.full(1, 1, context)
    for t in range(tokens):
        pos = context - tokens + t
        ref = reference_attention(q[t], K, V, pos, 1 / np.sqrt(D), window=window)
        bound = error_bound(q[t], K, V, pos, 1 / np.sqrt(D), window=window)
        assert np.abs(got[t] - ref).max() <= bound


OPTIONS = {
    "softcap": dict(softcap=5.0),
    "alibi": dict(alibi_slope=0.25),
    "alibi-per-head": dict(alibi_slope=np.array([0.5, 0.125, 0.0], dtype=np.float32)),
    "sink": dict(sink=1.5),
    "sink-per-head": dict(sink=np.array([-3.0, 0.0, 8.0], dtype=np.float32)),
    "all": dict(softcap=3.0, alibi_slope=0.0625, sink=0.25, window=11, scale=0.4),
}


@pytest.mark.parametrize("name", OPTIONS)
def test_masks_and_logit_options(name):
    opts = OPTIONS[name]
    syn, rng = synthetic(D), np.random.default_rng(len(name))
    atlas, base = _budgeted(2), unbounded(P, D)
    _sequence(atlas, base, syn, KeepSinksAndRecent(P, P), [3, 13, 30], rng, **opts)
    q = _query(rng, 3, D)
    context = 27
    got = atlas.attend(syn, AttentionRequest(0, 2, q, context, **opts), LRU())
    K, V = syn.full(0, 2, context)
    scale = opts.get("scale", 1 / np.sqrt(D))
    mask = dict(window=opts.get("window"), softcap=opts.get("softcap"),
                alibi=opts.get("alibi_slope"))
    ref = reference_attention(q, K, V, context - 1, scale, sink=opts.get("sink"), **mask)
    assert np.abs(got - ref).max() <= error_bound(q, K, V, context - 1, scale, **mask)


@pytest.mark.parametrize("storage_dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("budget_pages", [0, 1, 3])
def test_16bit_storage(storage_dtype, budget_pages):
    syn, rng = synthetic(D), np.random.default_rng(budget_pages)
    atlas = _budgeted(budget_pages, storage_dtype=storage_dtype)
    base = unbounded(P, D, storage_dtype)
    _sequence(atlas, base, syn, KeepRecent(P), [1, 6, 17, 30], rng, sink=0.5)
    q, context = _query(rng, 2, D), 29
    got = atlas.attend(syn, AttentionRequest(1, 0, q, context), LRU())
    K, V = (stored_rows(rows, storage_dtype) for rows in syn.full(1, 0, context))
    ref = reference_attention(q, K, V, context - 1, 1 / np.sqrt(D))
    assert np.abs(got - ref).max() <= error_bound(q, K, V, context - 1, 1 / np.sqrt(D))
    f32 = unbounded(P, D).attend(syn, AttentionRequest(1, 0, q, context))
    assert not np.array_equal(got, f32)  # the rounding really happened


def test_float16_widening_is_exact_for_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16).reshape(-1, 64)
    got = widen(bits, StorageDtype.FLOAT16)
    want = bits.view(np.float16).astype(np.float32)
    finite = np.isfinite(want)
    assert np.array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.array_equal(
        np.isinf(got), np.isinf(want))
    bf = widen(bits, StorageDtype.BFLOAT16)
    assert np.array_equal(bf.view(np.uint32), bits.astype(np.uint32) << 16)


def test_rounding_is_nearest_even():
    one = np.float32(1.0)
    # bfloat16 keeps 7 fraction bits: 1 + 2**-8 is a tie between 1 and 1 + 2**-7 (-> even: 1);
    # 1 + 3 * 2**-8 ties between 1 + 2**-7 and 1 + 2**-6 (-> even: 1 + 2**-6).
    x = np.array([[1 + 2**-8, 1 + 3 * 2**-8, 1 + 2**-8 + 2**-20, -(1 + 2**-8)]], dtype=np.float32)
    bf = widen(round_rows(x, StorageDtype.BFLOAT16), StorageDtype.BFLOAT16)
    assert bf.tolist() == [[one, 1 + 2**-6, 1 + 2**-7, -one]]
    y = np.array([[1 + 2**-11, 1 + 3 * 2**-11, 65519.0, 2.0**-25]], dtype=np.float32)
    f16 = widen(round_rows(y, StorageDtype.FLOAT16), StorageDtype.FLOAT16)
    assert f16.tolist() == [[one, 1 + 2**-9, 65504.0, 0.0]]


@pytest.mark.parametrize("budget_pages", [0, 2, 10])
@pytest.mark.parametrize("opts", [{}, dict(window=6, sink=0.5, alibi_slope=0.2, softcap=4.0)],
                         ids=["plain", "masked"])
def test_prefill_rows_equal_single_token_decode(budget_pages, opts):
    """Batch invariance of the fold: query row t of a chunk == a decode call at its position."""
    syn, rng = synthetic(D), np.random.default_rng(budget_pages)
    atlas, base = _budgeted(budget_pages), unbounded(P, D)
    tokens, context = 11, 26
    q = _query(rng, tokens, 3, D)
    chunk = atlas.attend(syn, AttentionRequest(0, 1, q, context, **opts), KeepRecent(P))
    for t in range(tokens):
        pos = context - tokens + t
        one = base.attend(syn, AttentionRequest(0, 1, q[t], pos + 1, **opts))
        assert np.array_equal(chunk[t], one), t


@pytest.mark.parametrize("budget_pages", [0, 3, 20])
def test_attend_heads_equals_separate_calls(budget_pages):
    syn, rng = synthetic(D), np.random.default_rng(5)
    heads = [2, 0, 1]
    alibi = rng.uniform(0, 0.3, (3, 2)).astype(np.float32)
    sinks = rng.uniform(-1, 1, (3, 2)).astype(np.float32)
    for context, tokens in ((9, 1), (22, 4)):
        q = _query(rng, tokens, 3, 2, D)
        out = np.full(q.shape, np.nan, dtype=np.float32)
        got = _budgeted(budget_pages).attend_heads(
            syn, 1, heads, q, context, KeepRecent(P), softcap=6.0, alibi=alibi, window=13,
            sinks=sinks, out=out)
        assert got is out
        base = unbounded(P, D)
        for hi, head in enumerate(heads):
            req = AttentionRequest(1, head, q[:, hi], context, softcap=6.0, alibi_slope=alibi[hi],
                                   window=13, sink=sinks[hi])
            assert np.array_equal(got[:, hi], base.attend(syn, req))


@pytest.mark.parametrize("storage_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("budget_pages", [2, 100])
def test_write_rows_path_equals_regeneration(storage_dtype, budget_pages):
    """Rows stored as the model computes them (write_rows) fold exactly like regenerated rows."""
    syn, rng = synthetic(D), np.random.default_rng(budget_pages)
    model = _budgeted(budget_pages, storage_dtype=storage_dtype)
    regen = _budgeted(0, storage_dtype=storage_dtype)
    counting = CountingKv(syn)
    policy = KeepAll() if budget_pages == 100 else KeepRecent(2 * P)
    pos = 0
    for chunk in (5, 1, 1, 3, 1, 9, 1, 1):  # a prefill, then decode steps and small chunks
        tokens = range(pos, pos + chunk)
        k = np.stack([syn.rows(0, h, tokens, 0) for h in range(3)], axis=1)
        v = np.stack([syn.rows(0, h, tokens, 1) for h in range(3)], axis=1)
        k_st, _ = model.write_rows(0, pos, k, v, policy)
        assert np.array_equal(k_st, round_rows(k, StorageDtype(storage_dtype)))
        pos += chunk
        for head in range(3):
            req = AttentionRequest(0, head, _query(rng, chunk, 2, D), pos)
            got = model.attend(counting, req, policy)
            assert np.array_equal(got, regen.attend(syn, req, NeverAdmit()))
    if budget_pages == 100:  # everything was written: nothing is ever regenerated
        assert not counting.calls


def test_out_buffer():
    syn, rng = synthetic(D), np.random.default_rng(9)
    atlas = _budgeted(1)
    for shape in [(D,), (3, D), (4, 3, D)]:
        q = _query(rng, *shape)
        req = AttentionRequest(0, 0, q, 14)
        out = np.full(shape, np.nan, dtype=np.float32)
        assert atlas.attend(syn, req, KeepRecent(P), out=out) is out
        assert np.array_equal(out, unbounded(P, D).attend(syn, req))
        assert out.shape == shape
