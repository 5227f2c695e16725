"""Errors: failing regenerators are transactional; bad requests raise typed errors.

A failure in the middle of a call (after that call has already admitted and evicted pages)
must leave the hot cache as before the call: resident bytes, resident pages, the slot / tokens
tables and the stored rows, exactly so while the slot pool had room; with a full pool (the pool
never grows past the budget) a victim whose slot a new page of the failed call reused stays
evicted, and every page still resident is exactly as before. Scratch wiped to zeros; the next
call correct.
"""

from __future__ import annotations

import numpy as np
import pytest
from atlas_reference import (
    FailingKv,
    cache_state,
    check_accounting,
    same_tables,
    synthetic,
    tables,
    unbounded,
)

from cfr_atlas import (
    Atlas,
    AtlasConfig,
    AttentionRequest,
    DimensionError,
    KeepAll,
    NumericError,
    PageError,
    RegeneratorError,
    SyntheticKv,
)
from cfr_atlas.atlas.storage import StorageDtype, round_rows

D, P = 8, 4


def _primed(storage_dtype: str, budget_pages: int = 6) -> Atlas:
    """An Atlas of `budget_pages` pages holding 5 (the last one partial) of layer 0, head 0."""
    itemsize = 4 if storage_dtype == "float32" else 2
    budget = budget_pages * P * 2 * D * itemsize
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget,
                              admit_regenerated_pages=True, storage_dtype=storage_dtype,
                              max_scratch_tokens=2 * P))
    q = np.ones((1, D), dtype=np.float32)
    atlas.attend(synthetic(D), AttentionRequest(0, 0, q, 18), KeepAll())
    assert atlas.telemetry().resident_pages == 5
    return atlas


def _scratch_is_zero(atlas: Atlas) -> bool:
    bufs = [atlas._scratch_k, atlas._scratch_v]
    bufs += [b for b in (atlas._stage_k, atlas._stage_v) if b is not None]
    return not any(b.any() for b in bufs)


@pytest.mark.parametrize("storage_dtype", ["float32", "float16"])
@pytest.mark.parametrize("mode", ["raise", "nan", "inf", "unwritten"])
@pytest.mark.parametrize("fail_at", [0, 3, 9])
@pytest.mark.parametrize("budget_pages", [6, 16])
def test_failure_mid_call_restores_everything(storage_dtype, mode, fail_at, budget_pages):
    syn = synthetic(D)
    atlas = _primed(storage_dtype, budget_pages)
    before, before_tables, total_calls = cache_state(atlas), tables(atlas), \
        atlas.telemetry().total.calls
    bad = FailingKv(syn, fail_at, mode)
    q = np.random.default_rng(fail_at).standard_normal((2, 2, 2, D)).astype(np.float32)
    # heads 0 and 1 at 28 tokens: head 0's partial page is stale (evicted first), head 1's pages
    # are regenerated and admitted by evicting head 0's older pages, then a page fails.
    with pytest.raises(RegeneratorError if mode == "raise" else NumericError) as info:
        atlas.attend_heads(bad, 0, [0, 1], q, 28, KeepAll())
    assert info.value.key == bad.failed_key
    assert str(bad.failed_key) in str(info.value)
    if mode == "raise":
        assert isinstance(info.value.__cause__, OSError)
    after = cache_state(atlas)
    if budget_pages == 16:  # the pool had room for every admission: restored exactly
        assert after == before
        assert same_tables(before_tables, tables(atlas))
    else:  # still-resident pages exactly as before; reused victims stay evicted
        assert after["pages"].items() <= before["pages"].items()
    assert _scratch_is_zero(atlas)
    assert atlas.telemetry().total.calls == total_calls
    check_accounting(atlas)
    got = atlas.attend_heads(syn, 0, [0, 1], q, 28, KeepAll())
    assert np.array_equal(got, unbounded(P, D, storage_dtype).attend_heads(syn, 0, [0, 1], q, 28))


def test_failing_call_had_changed_the_cache_before_failing():
    """Guard for the test above: the call that fails at page 9 did admit and evict first."""
    atlas = _primed("float32")
    q = np.ones((1, 2, 1, D), dtype=np.float32)
    atlas.attend_heads(synthetic(D), 0, [0, 1], q, 28, KeepAll())
    last = atlas.telemetry().last_call
    assert last.regenerations >= 10 and last.admissions > 0 and last.evictions > 0


class _Big:
    """Writes finite float32 rows that a 16-bit storage dtype cannot hold."""

    def __init__(self, value):
        self.value = value

    def regenerate_page(self, key, tokens, k_out, v_out):
        k_out[...] = 1.0
        v_out[...] = 1.0
        v_out[-1, -1] = self.value


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("storage_dtype,value", [("float16", 7e4), ("bfloat16", 3.4e38)])
def test_rows_overflowing_the_storage_dtype_are_numeric_errors(storage_dtype, value):
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, storage_dtype=storage_dtype))
    with pytest.raises(NumericError) as info:
        atlas.attend(_Big(value), AttentionRequest(0, 0, np.ones(D, np.float32), 6))
    assert info.value.key is not None
    assert _scratch_is_zero(atlas)
    rows = np.ones((3, 1, D), dtype=np.float32)
    big = rows.copy()
    big[1, 0, 2] = value
    with pytest.raises(NumericError):
        atlas.write_rows(0, 0, rows, big)
    assert atlas.telemetry().resident_bytes == 0


def _attend(atlas, **kw):
    req = dict(layer=0, kv_head=0, query=np.ones((2, D), np.float32), context_tokens=5)
    req.update(kw)
    return atlas.attend(SyntheticKv(0, 1, 1, D), AttentionRequest(**req))


BAD_REQUESTS = {
    "query wrong width": (dict(query=np.ones(D + 1, np.float32)), DimensionError),
    "query wrong group width": (dict(query=np.ones((2, D - 1), np.float32)), DimensionError),
    "query 4-d": (dict(query=np.ones((1, 1, 1, D), np.float32)), DimensionError),
    "query 0-d": (dict(query=np.float32(1.0)), DimensionError),
    "query a list": (dict(query=[1.0] * D), DimensionError),
    "query float64": (dict(query=np.ones(D)), DimensionError),
    "query nan": (dict(query=np.full(D, np.nan, np.float32)), NumericError),
    "query inf": (dict(query=np.full((2, D), np.inf, np.float32)), NumericError),
    "context < tokens": (dict(query=np.ones((3, 1, D), np.float32), context_tokens=2), PageError),
    "context 0": (dict(context_tokens=0), PageError),
    "context negative": (dict(context_tokens=-4), PageError),
    "layer negative": (dict(layer=-1), PageError),
    "layer bool": (dict(layer=True), PageError),
    "kv_head negative": (dict(kv_head=-2), PageError),
    "window 0": (dict(window=0), PageError),
    "window float": (dict(window=2.5), PageError),
    "scale 0": (dict(scale=0.0), NumericError),
    "scale nan": (dict(scale=float("nan")), NumericError),
    "softcap negative": (dict(softcap=-1.0), NumericError),
    "softcap inf": (dict(softcap=float("inf")), NumericError),
    "sink nan": (dict(sink=float("nan")), NumericError),
    "alibi inf": (dict(alibi_slope=float("inf")), NumericError),
    "alibi wrong length": (dict(alibi_slope=np.ones(3, np.float32)), DimensionError),
    "sink wrong length": (dict(sink=np.ones(5, np.float32)), DimensionError),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_raise_typed_errors(name):
    kw, error = BAD_REQUESTS[name]
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D))
    with pytest.raises(error):
        _attend(atlas, **kw)
    assert atlas.telemetry().total.calls == 0


def test_bad_attend_heads_and_out():
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=1 << 20,
                              admit_regenerated_pages=True))
    syn = SyntheticKv(0, 1, 2, D)
    q = np.ones((1, 2, 1, D), np.float32)
    with pytest.raises(PageError):
        atlas.attend_heads(syn, 0, [1, 1], q, 9)  # a head twice would be admitted twice
    with pytest.raises(PageError):
        atlas.attend_heads(syn, 0, [], q[:, :0], 9)
    with pytest.raises(DimensionError):
        atlas.attend_heads(syn, 0, [0], q, 9)  # 2 heads of queries for 1 K/V head
    with pytest.raises(DimensionError):
        atlas.attend_heads(syn, 0, [0, 1], q, 9, alibi=np.ones((3, 1), np.float32))
    for out in (np.empty((1, 2, 1, D), np.float64), np.empty((1, 2, 1, D + 1), np.float32)):
        with pytest.raises(DimensionError):
            atlas.attend_heads(syn, 0, [0, 1], q, 9, out=out)
    with pytest.raises(DimensionError):  # attend's out= must match the query's shape
        atlas.attend(syn, AttentionRequest(0, 0, np.ones(D, np.float32), 3),
                     out=np.empty((1, D), np.float32))
    with pytest.raises(PageError):  # a head the regenerator does not have: its own typed error
        atlas.attend(syn, AttentionRequest(0, 5, np.ones(D, np.float32), 3))
    assert atlas.telemetry().resident_bytes == 0
    with pytest.raises(TypeError):
        Atlas({"page_tokens": P, "head_dim": D})


BAD_ROWS = {
    "2-d rows": (np.ones((3, D), np.float32), np.ones((3, D), np.float32), {}, DimensionError),
    "wrong width": (np.ones((3, 1, D + 1), np.float32),) * 2 + ({}, DimensionError),
    "k/v shapes differ": (np.ones((3, 1, D), np.float32), np.ones((2, 1, D), np.float32), {},
                          DimensionError),
    "not finite": (np.ones((3, 1, D), np.float32), np.full((3, 1, D), np.nan, np.float32), {},
                   NumericError),
    "heads != columns": (np.ones((3, 2, D), np.float32),) * 2 + ({"kv_heads": [0]},
                                                                 DimensionError),
    "negative start": (np.ones((3, 1, D), np.float32),) * 2 + ({"start_token": -1}, PageError),
}


@pytest.mark.parametrize("name", BAD_ROWS)
def test_bad_write_rows(name):
    k, v, kw, error = BAD_ROWS[name]
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=1 << 20))
    with pytest.raises(error):
        atlas.write_rows(0, kw.pop("start_token", 0), k, v, **kw)
    assert atlas.telemetry().resident_bytes == 0


@pytest.mark.filterwarnings("ignore:overflow encountered")
@pytest.mark.parametrize("storage_dtype", ["float32", "float16", "bfloat16"])
def test_stored_rows_catch_every_bad_element(storage_dtype):
    """The compiled check of `stored_rows` (an OR over the exponent bits) sees a NaN, an inf or
    an overflow of the storage dtype at any position of K or V; clean rows come back rounded."""
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, storage_dtype=storage_dtype))
    rows = np.random.default_rng(3).standard_normal((3, 2, D)).astype(np.float32)
    k_st, v_st = atlas.stored_rows(0, rows, rows[::-1].copy())
    assert np.array_equal(k_st, round_rows(rows, StorageDtype(storage_dtype)))
    big = {"float32": None, "float16": 7e4, "bfloat16": 3.4e38}[storage_dtype]
    for value in [np.nan, np.inf, -np.inf] + ([big] if big else []):
        for which in range(2):
            for pos in np.ndindex(rows.shape):
                bad = rows.copy()
                bad[pos] = value
                pair = (bad, rows) if which == 0 else (rows, bad)
                with pytest.raises(NumericError):
                    atlas.stored_rows(0, *pair)
