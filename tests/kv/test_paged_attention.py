"""A PagedKvCache as the Atlas's regenerator: attention with nothing hot (budget 0, NeverAdmit)
reading every page from the block table is bitwise equal to attention over the same rows held
in an unbounded hot cache (`Atlas.write_rows`), for every storage dtype, through forks."""

from __future__ import annotations

import numpy as np
import pytest
from kv_helpers import NoRegeneration

from cfr_atlas import Atlas, AtlasConfig, KeepAll, NeverAdmit, PageKey
from cfr_atlas.atlas import StorageDtype
from cfr_atlas.errors import PageError
from cfr_atlas.kv import KvBlockPool, PagedKvCache

L, H, G, D, P = 2, 3, 2, 16, 4


def _atlases(storage_dtype: str) -> tuple[Atlas, Atlas]:
    cold = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=0,
                             storage_dtype=storage_dtype, max_scratch_tokens=2 * P))
    hot = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=1 << 40,
                            storage_dtype=storage_dtype))
    return cold, hot


def _attend_both(cold, hot, seq, rng, context, n_query, window=None):
    for layer in range(L):
        q = rng.standard_normal((n_query, H, G, D)).astype(np.float32)
        got = cold.attend_heads(seq, layer, range(H), q, context, NeverAdmit(), window=window)
        want = hot.attend_heads(NoRegeneration(), layer, range(H), q, context, KeepAll(),
                                window=window)
        assert np.array_equal(got, want), (context, layer)


def _append_both(seq, hot, rows_k, rows_v):
    start = seq.n_tokens
    seq.append(rows_k, rows_v)
    for layer in range(L):
        hot.write_rows(layer, start, rows_k[:, layer], rows_v[:, layer], KeepAll())


@pytest.mark.parametrize("storage_dtype", ["float32", "float16", "bfloat16"])
def test_paged_cache_attention_equals_hot_rows_bitwise(storage_dtype):
    rng = np.random.default_rng(3)
    pool = KvBlockPool(16, P, L, H, D, StorageDtype(storage_dtype))
    seq = PagedKvCache(pool, page_tokens=P)
    cold, hot = _atlases(storage_dtype)
    for i, n in enumerate([1, 3, 5, 2, 7, 4, 1, 9]):
        k = rng.standard_normal((n, L, H, D)).astype(np.float32) * 3
        v = rng.standard_normal((n, L, H, D)).astype(np.float32)
        _append_both(seq, hot, k, v)
        _attend_both(cold, hot, seq, rng, seq.n_tokens, min(n, 3), window=(5 if i % 3 else None))
    assert cold.telemetry().total.regenerations > 0
    assert cold.cache.resident_bytes == 0


def test_forks_attend_like_their_own_contiguous_rows():
    rng = np.random.default_rng(4)
    pool = KvBlockPool(12, P, L, H, D, StorageDtype.FLOAT16)
    a, (cold, hot_a) = PagedKvCache(pool), _atlases("float16")
    prefix = [rng.standard_normal((6, L, H, D)).astype(np.float32) for _ in range(2)]
    _append_both(a, hot_a, *prefix)
    b, (_, hot_b) = a.fork(), _atlases("float16")
    for layer in range(L):
        hot_b.write_rows(layer, 0, prefix[0][:, layer], prefix[1][:, layer], KeepAll())
    for seq, hot in ((a, hot_a), (b, hot_b), (a, hot_a), (b, hot_b)):
        rows = [rng.standard_normal((3, L, H, D)).astype(np.float32) for _ in range(2)]
        _append_both(seq, hot, *rows)
        _attend_both(cold, hot, seq, rng, seq.n_tokens, 2)
    assert a.table[0] == b.table[0] and a.table[1:] != b.table[1:]


def test_page_size_must_equal_block_size():
    pool = KvBlockPool(4, P, L, H, D, StorageDtype.FLOAT32)
    with pytest.raises(PageError, match="page_tokens 8 must equal the pool's block_tokens 4"):
        PagedKvCache(pool, page_tokens=8)
    seq = PagedKvCache(pool)
    seq.append(np.ones((10, L, H, D), np.float32), np.ones((10, L, H, D), np.float32))
    out = np.zeros((2, D), np.float32)
    with pytest.raises(PageError, match="page_tokens must equal block_tokens 4"):
        seq.regenerate_page(PageKey(0, 0, 2), range(2, 4), out, out)
    with pytest.raises(PageError, match="the sequence holds 10"):
        seq.regenerate_page(PageKey(0, 0, 8), range(8, 12), np.zeros((4, D), np.float32),
                            np.zeros((4, D), np.float32))
    small = Atlas(AtlasConfig(page_tokens=2, head_dim=D))
    q = np.ones((1, 1, 1, D), np.float32)
    with pytest.raises(PageError, match="block_tokens 4"):
        small.attend_heads(seq, 0, [0], q, 10, NeverAdmit())


def test_whole_blocks_export_and_import():
    rng = np.random.default_rng(5)
    pool = KvBlockPool(6, P, L, H, D, StorageDtype.BFLOAT16)
    a, b = PagedKvCache(pool), PagedKvCache(pool)
    rows = rng.standard_normal((9, L, H, D)).astype(np.float32)
    a.append(rows, -rows)
    for i in range(2):
        b.append_block(*a.block_arrays(i))
    assert b.n_tokens == 8
    assert np.array_equal(pool.k[b.table], pool.k[a.table[:2]])
    with pytest.raises(PageError, match="block 2 is not a whole block of a sequence of 9"):
        a.block_arrays(2)
