"""PrefixCache: longest run of cached whole blocks, RAM over disk with promotion, LRU under the
RAM budget, signature and extra keys separating entries, and a full round trip: blocks of a
paged sequence stored, found again by a fresh cache over the same folder, and attended to
bitwise like the original."""

from __future__ import annotations

import numpy as np
import pytest
from kv_helpers import SIG, make_block, same_block, signature

from cfr_atlas import Atlas, AtlasConfig, NeverAdmit
from cfr_atlas.errors import IncompatibleBlockError
from cfr_atlas.kv import (
    DiskKvStore,
    KvBlock,
    KvBlockPool,
    PagedKvCache,
    PrefixCache,
    chain_hashes,
)

IDS = list(range(7, 7 + 4 * 6))  # 6 whole blocks of 4
ONE = make_block(IDS, 0).nbytes


def _disk(path, **kw) -> DiskKvStore:
    return DiskKvStore(path, budget_bytes=1 << 20, reserve_bytes=0, background=False, **kw)


def test_lookup_returns_the_longest_cached_run_from_the_start():
    cache = PrefixCache(SIG, ram_bytes=1 << 20)
    assert cache.lookup(cache.root(), IDS) == [] and cache.stats().misses == 1
    blocks = [make_block(IDS, i) for i in range(6)]
    for i in (0, 1, 2, 4):
        cache.insert(blocks[i])
    found = cache.lookup(cache.root(), IDS)
    assert [b.hash for b in found] == [b.hash for b in blocks[:3]]   # block 3 missing: stop
    assert cache.lookup(cache.root(), IDS[:10]) == blocks[:2]        # partial tail ignored
    other = IDS[:5] + [99] + IDS[6:]
    assert cache.lookup(cache.root(), other) == blocks[:1]            # diverges in block 1
    s = cache.stats()
    assert (s.ram_hits, s.disk_hits, s.misses, s.ram_blocks) == (6, 0, 3, 4)


def test_ram_lru_budget_and_disk_promotion(tmp_path):
    disk = _disk(tmp_path)
    cache = PrefixCache(SIG, ram_bytes=2 * ONE, disk=disk)
    blocks = [make_block(IDS, i) for i in range(4)]
    for block in blocks:
        cache.insert(block)
    assert cache.stats().ram_blocks == 2 and cache.ram_bytes_used == 2 * ONE
    found = cache.lookup(cache.root(), IDS)
    assert all(same_block(a, b) for a, b in zip(found, blocks, strict=True))
    s = cache.stats()
    assert (s.disk_hits, s.ram_hits) == (2, 2)  # RAM held the last two inserted, 2 and 3
    assert s.ram_bytes <= 2 * ONE
    cache.lookup(cache.root(), IDS[:8])         # promoted tail first: 0 and 1 stayed
    assert (cache.stats().disk_hits, cache.stats().ram_hits) == (2, 4)
    disk.close()


def test_zero_ram_budget_keeps_nothing_in_ram(tmp_path):
    disk = _disk(tmp_path)
    cache = PrefixCache(SIG, ram_bytes=0, disk=disk)
    cache.insert(make_block(IDS, 0))
    assert cache.stats().ram_blocks == 0 and len(cache.lookup(cache.root(), IDS)) == 1
    disk.close()


def test_signature_and_extra_keys_separate_entries(tmp_path):
    cache = PrefixCache(SIG, ram_bytes=1 << 20)
    with pytest.raises(IncompatibleBlockError, match="head_dim"):
        cache.insert(make_block(IDS, 0, signature(head_dim=16)))
    plain = make_block(IDS, 0)
    root = cache.root()
    (h,) = chain_hashes(root, IDS[:4], 4, ["adapter-a"])
    adapted = KvBlock(h, plain.token_ids, SIG, plain.k, plain.v)
    cache.insert(adapted)
    assert cache.lookup(root, IDS) == []
    assert cache.lookup(root, IDS, ["adapter-a"]) == [adapted]
    assert cache.root(["x"]) != root and PrefixCache(signature(rope_theta=1e6),
                                                     ram_bytes=0).root() != root


def test_blocks_survive_a_restart_and_attend_bitwise(tmp_path):
    L, H, D, B = SIG.n_layers, SIG.n_kv_heads, SIG.head_dim, SIG.block_tokens
    rng = np.random.default_rng(9)
    pool = KvBlockPool(16, B, L, H, D, SIG.dtype)
    seq = PagedKvCache(pool)
    rows = rng.standard_normal((len(IDS) + 3, L, H, D)).astype(np.float32)
    seq.append(rows, rows[::-1].copy())
    with _disk(tmp_path) as disk:                  # first process: compute once, store
        cache = PrefixCache(SIG, ram_bytes=1 << 20, disk=disk)
        for i, h in enumerate(chain_hashes(cache.root(), IDS, B)):
            k, v = seq.block_arrays(i)
            cache.insert(KvBlock(h, np.asarray(IDS[i * B:(i + 1) * B], np.int64), SIG, k, v))
    with _disk(tmp_path) as disk:                  # later: a fresh cache over the same folder
        cache = PrefixCache(SIG, ram_bytes=1 << 20, disk=disk)
        found = cache.lookup(cache.root(), IDS + [1, 2])
        assert len(found) == 6 and cache.stats().disk_hits == 6
        restored = PagedKvCache(pool)
        for block in found:
            restored.append_block(block.k, block.v)
    atlas = Atlas(AtlasConfig(page_tokens=B, head_dim=D, storage_dtype=SIG.storage_dtype))
    q = rng.standard_normal((2, H, 1, D)).astype(np.float32)
    for layer in range(L):
        got = atlas.attend_heads(restored, layer, range(H), q, len(IDS), NeverAdmit())
        want = atlas.attend_heads(seq, layer, range(H), q, len(IDS), NeverAdmit())
        assert np.array_equal(got, want)
