"""Block-sparse (MiniMax-style) selection through the sparse page walk: top-k blocks by the
mean-pooled keys plus the query's own block; dense reference tests and the page guarantees."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.atlas import Atlas, AtlasConfig, SyntheticKv
from cfr_atlas.atlas.sparse import attend_selected
from cfr_atlas.errors import DimensionError
from cfr_atlas.ops import block_means, block_select

P, D, G, N, B = 8, 16, 4, 100, 16  # blocks of 16 tokens = 2 pages


def _kv():
    return SyntheticKv(11, 1, 1, D)


def _atlas(budget):
    kv = _kv()
    k, v = kv.full(0, 0, N)
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget))
    atlas.write_rows(0, 0, k[:, None], v[:, None])
    return atlas, kv


def test_block_means_and_selection_against_float64():
    k = _kv().full(0, 0, N)[0]
    means = block_means(k, B)
    ref = [k[i:i + B].astype(np.float64).mean(axis=0) for i in range(0, N, B)]
    assert np.abs(means - np.array(ref)).max() < 1e-6
    q = np.random.default_rng(0).standard_normal((3, G, D)).astype(np.float32)
    sel = block_select(q, means, N, 2, B)
    for t in range(3):
        pos = N - 3 + t
        own = pos // B
        s = [sum(q[t, h].astype(np.float64) @ ref[b] for h in range(G)) for b in range(own)]
        top = sorted(sorted(range(own), key=lambda b: (-s[b], b))[:2])
        want = [j for b in top for j in range(b * B, (b + 1) * B)] + list(range(own * B, pos + 1))
        live = sel[t][sel[t] >= 0].tolist()
        assert live == want and max(live) == pos


def test_ties_go_to_the_lower_block_and_rows_are_independent():
    means = np.zeros((7, D), np.float32)
    q = np.ones((1, 1, D), np.float32)
    sel = block_select(q, means, N, 2, B)[0]
    assert sel[sel >= 0].tolist()[:2 * B] == list(range(2 * B))  # blocks 0 and 1
    k = _kv().full(0, 0, N)[0]
    qs = np.random.default_rng(1).standard_normal((4, G, D)).astype(np.float32)
    whole = block_select(qs, block_means(k, B), N, 3, B)
    alone = block_select(qs[1:2], block_means(k[:N - 2], B), N - 2, 3, B)
    assert np.array_equal(alone[0], whole[1])
    with pytest.raises(DimensionError):
        block_select(qs, block_means(k, B), N + B, 3, B)


@pytest.mark.parametrize("budget", [0, 3 * P * D * 8, 1 << 20])
def test_attention_over_the_blocks_is_exact(budget):
    k, v = _kv().full(0, 0, N)
    q = np.random.default_rng(2).standard_normal((2, 1, G, D)).astype(np.float32)
    sel = block_select(q[:, 0], block_means(k, B), N, 2, B)
    full = attend_selected(*_atlas(1 << 20), 0, [0], q, N, sel)
    atlas, kv = _atlas(budget)
    got = attend_selected(atlas, kv, 0, [0], q, N, sel)
    assert np.array_equal(got, full)
    assert atlas.telemetry().last_call.pages_skipped > 0
    for t in range(2):
        idx = sel[t][sel[t] >= 0]
        s = q[t, 0].astype(np.float64) @ k[idx].T.astype(np.float64) / np.sqrt(D)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        ref = w / w.sum(axis=1, keepdims=True) @ v[idx].astype(np.float64)
        assert np.abs(got[t, 0] - ref).max() < 1e-5
