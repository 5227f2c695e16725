"""Sparse attention through the page walk (atlas/sparse.py): each query folds only its
selected tokens; pages nobody selects are neither regenerated nor folded.

Bitwise against the same fold on a gathered copy (an unbounded Atlas holding only the selected
rows, in order), within 1e-5 of a float64 reference, budgeted == unbounded bitwise.
"""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.atlas import Atlas, AtlasConfig, SyntheticKv
from cfr_atlas.atlas.sparse import attend_selected, read_stream
from cfr_atlas.errors import PageError
from cfr_atlas.ops import lightning_indexer_topk

P, D, H, G, N = 8, 16, 2, 3, 90


def _atlas(budget, dtype="float32"):
    cfg = AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget, storage_dtype=dtype)
    atlas, kv = Atlas(cfg), SyntheticKv(7, 1, H, D)
    k, v = zip(*(kv.full(0, h, N) for h in range(H)), strict=True)
    atlas.write_rows(0, 0, np.stack(k, axis=1), np.stack(v, axis=1))
    return atlas, kv


def _select(T, top_k, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((T, 4, 8)).astype(np.float32)
    keys = rng.standard_normal((N, 8)).astype(np.float32)
    return lightning_indexer_topk(q, np.ones(4, np.float32), keys, top_k)


def _query(T, seed=1):
    return np.random.default_rng(seed).standard_normal((T, H, G, D)).astype(np.float32)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_equals_the_same_fold_on_a_gathered_copy(dtype):
    atlas, kv = _atlas(1 << 20, dtype)
    q, sel = _query(3), _select(3, 20)
    got = attend_selected(atlas, kv, 0, range(H), q, N, sel)
    for t in range(3):
        idx = sel[t][sel[t] >= 0]
        gathered = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=1 << 20,
                                     storage_dtype=dtype))
        k, v = zip(*(kv.full(0, h, N) for h in range(H)), strict=True)
        gathered.write_rows(0, 0, np.stack(k, axis=1)[idx], np.stack(v, axis=1)[idx])
        dense = gathered.attend_heads(kv, 0, range(H), q[t:t + 1], len(idx))
        assert np.array_equal(got[t:t + 1], dense)


def test_matches_float64_restricted_attention():
    atlas, kv = _atlas(1 << 20)
    q, sel = _query(2), _select(2, 33)
    got = attend_selected(atlas, kv, 0, range(H), q, N, sel)
    for t in range(2):
        idx = sel[t][sel[t] >= 0]
        for h in range(H):
            k, v = (x.astype(np.float64)[idx] for x in kv.full(0, h, N))
            s = q[t, h].astype(np.float64) @ k.T / np.sqrt(D)
            w = np.exp(s - s.max(axis=1, keepdims=True))
            ref = w / w.sum(axis=1, keepdims=True) @ v
            assert np.abs(got[t, h] - ref).max() < 1e-5


@pytest.mark.parametrize("budget", [0, 2 * P * D * 8, 5 * P * D * 8])
def test_budgeted_equals_unbounded_and_skips_unselected_pages(budget):
    q, sel = _query(1), _select(1, 12)
    full = attend_selected(*_atlas(1 << 20), 0, range(H), q, N, sel)
    atlas, kv = _atlas(budget)
    kv.calls = 0
    got = attend_selected(atlas, kv, 0, range(H), q, N, sel)
    assert np.array_equal(got, full)
    last = atlas.telemetry().last_call
    read = len(np.unique(sel[sel >= 0] // P))
    total = -(-N // P)
    assert last.pages_skipped == H * (total - read) > 0
    assert last.pages_folded == H * read
    assert kv.calls == last.regenerations <= H * read  # only selected pages come back


def test_selection_is_checked():
    atlas, kv = _atlas(1 << 20)
    with pytest.raises(PageError, match="outside"):
        attend_selected(atlas, kv, 0, range(H), _query(1), N, np.array([[0, N]]))
    with pytest.raises(PageError, match="ascending"):
        attend_selected(atlas, kv, 0, range(H), _query(1), N, np.array([[5, 3]]))


def test_the_index_stream_is_virtual_like_the_main_one():
    """Index keys in a K-only stream (value_dim=1: no V bytes): read back under budget 0 (all
    regenerated) they equal the resident ones, so the selection is the same."""
    keys = SyntheticKv(3, 1, 1, 8)
    k = keys.full(0, 0, N)[0]

    class Keys:
        def regenerate_page(self, key, tokens, k_out, v_out):
            k_out[...] = k[tokens.start:tokens.stop]

    streams = []
    for budget in (1 << 20, 0):
        cfg = AtlasConfig(page_tokens=P, head_dim=8, value_dim=1, hot_cache_bytes=budget)
        a = Atlas(cfg)
        a.write_rows(0, 0, k[:, None], np.empty((N, 1, 0), np.float32))
        streams.append(read_stream(a, Keys(), 0, 0, N))
    assert np.array_equal(streams[0], k) and np.array_equal(streams[1], k)
    q = np.random.default_rng(5).standard_normal((1, 2, 8)).astype(np.float32)
    assert np.array_equal(lightning_indexer_topk(q, np.ones(2, np.float32), streams[1], 9),
                          lightning_indexer_topk(q, np.ones(2, np.float32), k, 9))
