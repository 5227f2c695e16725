"""Telemetry counters add up per call and in total, and render as a table."""

from __future__ import annotations

import numpy as np
from atlas_reference import synthetic

from cfr_atlas import Atlas, AtlasConfig, AttentionRequest, KeepAll, KeepRecent, NeverAdmit

D, P = 8, 4
ROW_BYTES = 2 * D * 4


def _atlas(budget_pages: int, **kw) -> Atlas:
    budget = budget_pages * P * ROW_BYTES
    return Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget,
                             admit_regenerated_pages=True, **kw))


def test_counters_of_one_call_add_up():
    syn, atlas = synthetic(D), _atlas(3)
    q = np.ones((2, D), np.float32)
    atlas.attend(syn, AttentionRequest(0, 0, q, 18), KeepRecent(2 * P))  # 5 pages, last partial
    c = atlas.telemetry().last_call
    assert (c.calls, c.pages_folded, c.hot_hits, c.regenerations) == (1, 5, 0, 5)
    assert c.tokens_consumed == 18 and c.bytes_regenerated == 18 * ROW_BYTES
    assert c.admissions == 3  # pages overlapping the last 8 tokens (10..17): 8, 12, 16
    assert c.regen_seconds >= 0 and c.fold_seconds > 0
    atlas.attend(syn, AttentionRequest(0, 0, q, 18), KeepRecent(2 * P))
    c = atlas.telemetry().last_call
    assert (c.hot_hits, c.regenerations, c.admissions) == (3, 2, 0)
    assert c.hot_hits + c.regenerations == c.pages_folded == 5
    assert c.bytes_regenerated == 8 * ROW_BYTES
    assert c.hit_rate == 3 / 5


def test_window_counts_only_pages_it_reaches():
    syn, atlas = synthetic(D), _atlas(0)
    atlas.attend(syn, AttentionRequest(0, 0, np.ones(D, np.float32), 40, window=6), NeverAdmit())
    c = atlas.telemetry().last_call
    assert (c.pages_folded, c.regenerations, c.tokens_consumed) == (2, 2, 8)  # pages 32, 36


def test_totals_accumulate_and_evictions_are_counted():
    syn, atlas = synthetic(D), _atlas(2)
    q = np.ones((1, 2, 1, D), np.float32)
    seen = []
    for context in (4, 8, 12, 16):
        atlas.attend_heads(syn, 1, [0, 1], q, context, KeepAll())
        seen.append(atlas.telemetry().last_call)
    tel = atlas.telemetry()
    for name in ("calls", "pages_folded", "hot_hits", "regenerations", "admissions",
                 "evictions", "tokens_consumed", "bytes_regenerated"):
        assert getattr(tel.total, name) == sum(getattr(c, name) for c in seen), name
    assert tel.total.calls == 4 and tel.total.pages_folded == 2 * (1 + 2 + 3 + 4)
    assert tel.total.evictions > 0
    assert tel.resident_pages == 2 and tel.resident_bytes == 2 * P * ROW_BYTES
    assert tel.peak_resident_bytes >= tel.resident_bytes
    assert tel.budget_bytes == 2 * P * ROW_BYTES
    assert tel.scratch_bytes == 2 * (2 * P * D * 4)  # a scratch page of K and V + staging rows


def test_write_rows_is_counted_as_a_call_and_fills_the_cache():
    atlas = _atlas(10)
    rows = np.ones((6, 2, D), np.float32)
    atlas.write_rows(0, 0, rows, rows)
    tel = atlas.telemetry()
    assert tel.total.calls == 1 and tel.last_call.admissions == 4  # 2 heads x pages 0, 4
    assert tel.resident_bytes == 12 * ROW_BYTES


def test_str_renders_a_table():
    syn, atlas = synthetic(D), _atlas(3)
    atlas.attend(syn, AttentionRequest(0, 0, np.ones(D, np.float32), 10), KeepAll())
    text = str(atlas.telemetry())
    lines = text.splitlines()
    assert lines[0].split() == ["metric", "last", "call", "total"]
    assert set(lines[1]) == {"-"}
    for name in ("pages_folded", "hot_hits", "regenerations", "hot hit rate", "resident_bytes",
                 "peak_resident_bytes", "scratch_bytes", "budget_bytes"):
        assert any(line.startswith(name) for line in lines), name
    assert len({len(line) for line in lines}) == 1  # columns aligned
    assert text == atlas.telemetry().table()


def test_scratch_bytes_count_16bit_staging_rows():
    cfg = AtlasConfig(page_tokens=P, head_dim=D, storage_dtype="bfloat16", max_scratch_tokens=3 * P)
    tel = Atlas(cfg).telemetry()
    assert tel.scratch_bytes == 3 * P * 2 * D * 2 + 2 * P * D * 4  # 3 pages + float32 staging


def test_a_partial_page_is_charged_a_whole_slot_and_the_pool_stays_within_budget():
    budget = int(2.5 * P * ROW_BYTES)  # room for 2 slots, not 3
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget,
                              admit_regenerated_pages=True))
    one = np.ones((1, 3, D), np.float32)
    atlas.write_rows(0, 0, one, one)  # 3 heads x 1 token: three partial pages, 2 slots
    tel = atlas.telemetry()
    assert tel.resident_pages == 2 and tel.resident_bytes == 2 * ROW_BYTES
    assert tel.held_bytes == 2 * P * ROW_BYTES <= budget
    assert atlas.cache.k.nbytes + atlas.cache.v.nbytes <= budget


def test_a_preallocated_pool_is_allocated_once_and_never_reallocated():
    budget = 5 * P * ROW_BYTES
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget,
                              admit_regenerated_pages=True, preallocate_hot_cache=True))
    syn = synthetic(D)
    assert atlas.cache.k.nbytes == 0  # nothing until the first admission
    atlas.attend(syn, AttentionRequest(0, 0, np.ones(D, np.float32), 2), KeepAll())
    pool = atlas.cache.k, atlas.cache.v
    assert pool[0].nbytes + pool[1].nbytes == budget
    for context in range(3, 60, 5):
        for layer in (0, 1):
            atlas.attend(syn, AttentionRequest(layer, 1, np.ones(D, np.float32), context),
                         KeepAll())
    assert atlas.cache.k is pool[0] and atlas.cache.v is pool[1]
    tel = atlas.telemetry()
    assert tel.allocated_bytes == budget + atlas.config.scratch_bytes
    assert tel.peak_allocated_bytes == tel.allocated_bytes
    atlas.reset()  # releases the pool
    assert atlas.telemetry().allocated_bytes == atlas.config.scratch_bytes
