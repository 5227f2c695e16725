"""Read-ahead of the spill page file (kv/page_file.py): which byte ranges it asks the disk for,
that it asks only for pages not cached, and that its thread ends with the file."""

from __future__ import annotations

import ctypes
import errno
import os

import numpy as np
import pytest

from cfr_atlas.atlas.storage import StorageDtype
from cfr_atlas.kv import SpillKv
from cfr_atlas.kv import page_file as pf

P, D, L, H, N = 4, 8, 4, 2, 64


@pytest.fixture
def spill(tmp_path):
    s = SpillKv(tmp_path, P, D, StorageDtype.FLOAT16, "ab" * 32, n_layers=L, n_kv_heads=H,
                context_tokens=N)
    rng = np.random.default_rng(0)
    for layer in range(L):
        k, v = (rng.standard_normal((40, H, D)).astype(np.float32) for _ in range(2))
        s.record(layer, 0, None, k, v)  # 10 pages of each head
    yield s
    s.close()


@pytest.fixture
def hinted(monkeypatch):
    """Every (offset, length) handed to posix_fadvise(WILLNEED), in order."""
    calls: list[tuple[int, int]] = []
    monkeypatch.setattr(pf, "_advise", lambda fd, ranges: calls.extend(ranges))
    return calls


def _expected(spill, layer, want):
    """The ranges of `want` (H, pages) plus each head's last page, by hand: one range per run
    of pages per head and slab, then merged where they touch."""
    out = []
    for h in range(H):
        row = list(want[h])
        row[-1] = True
        slot0 = (layer * H + h) * spill.n_pages
        for base, size in ((pf.HDR_BYTES, spill.page_bytes),
                           (pf.HDR_BYTES + L * H * spill.n_pages * spill.page_bytes,
                            spill.v_page_bytes)):
            p = 0
            while p < len(row):
                if row[p]:
                    q = p
                    while q < len(row) and row[q]:
                        q += 1
                    out.append((base + (slot0 + p) * size, (q - p) * size))
                    p = q
                else:
                    p += 1
    out.sort()
    merged = []
    for a, n in out:
        if merged and a <= sum(merged[-1]):
            merged[-1] = (merged[-1][0], max(merged[-1][1], a + n - merged[-1][0]))
        else:
            merged.append((a, n))
    return merged


def test_coalesce_merges_only_touching_ranges():
    assert pf._coalesce([(500, 10), (0, 100), (100, 5)]) == [(0, 105), (500, 10)]
    assert pf._coalesce([(0, 10), (11, 1)]) == [(0, 10), (11, 1)]  # one byte apart: two reads
    assert pf._coalesce([(0, 100), (10, 20)]) == [(0, 100)]  # contained
    assert pf._coalesce([]) == []


def test_ranges_cover_the_pages_the_last_fold_read_and_the_write_target(spill):
    pages = 10
    assert spill._ranges(2) == _expected(spill, 2, np.ones((H, pages), bool))  # never folded
    need = np.zeros((H, pages), bool)
    need[0, 2:5] = need[1, 7] = True  # the rest was hot
    lens = np.full(pages, P)
    spill.map_pages(2, np.arange(H), 0, lens, need)
    assert spill._ranges(2) == _expected(spill, 2, need)
    # a sliding window: pages before `lo` are not read again
    spill.map_pages(3, np.arange(H), 6, lens[6:], np.ones((H, 4), bool))
    want = np.zeros((H, pages), bool)
    want[:, 6:] = True
    assert spill._ranges(3) == _expected(spill, 3, want)
    # a fold with every page hot: nothing of the layer is read ahead but the write target
    spill.map_pages(1, np.arange(H), 0, lens, np.zeros((H, pages), bool))
    assert spill._ranges(1) == _expected(spill, 1, np.zeros((H, pages), bool))
    assert len(spill._ranges(1)) == 2 * H


def test_a_store_into_an_evicted_page_of_a_sparse_layer_asks_for_exactly_it(spill, hinted):
    need = np.zeros((H, 10), bool)
    spill.map_pages(2, np.arange(H), 0, np.full(10, P), need)  # every page hot: sparse
    spill.evict_page_cache()
    k = np.ones((1, H, D), np.float32)
    spill.record(2, 40, None, k, k)  # token 40: page 10 of each head (first row)
    slot = [(2 * H + h) * spill.n_pages + 10 for h in range(H)]
    v0 = pf.HDR_BYTES + L * H * spill.n_pages * spill.page_bytes
    assert hinted == [r for s in slot for r in ((pf.HDR_BYTES + s * spill.page_bytes,
                                                 spill.page_bytes),
                                                (v0 + s * spill.v_page_bytes,
                                                 spill.v_page_bytes))]
    hinted.clear()
    spill.record(2, 41, None, k, k)  # its page is cached now: no hint
    assert hinted == []


def _read_randomly(spill, layer: int) -> bool:
    """Whether the kernel maps `layer`'s K slots MADV_RANDOM ("rr" in the VmFlags of its
    mapping in /proc/self/smaps)."""
    address = spill._base + pf.HDR_BYTES + layer * H * spill.n_pages * spill.page_bytes
    area = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                area = lo <= address < hi
            elif area and line.startswith("VmFlags:"):
                return "rr" in line.split()
    raise AssertionError("address not mapped")


def test_dense_layers_are_not_hinted_sparse_ones_are(spill, hinted):
    lens = np.full(10, P)
    dense, sparse = np.ones((H, 10), bool), np.zeros((H, 10), bool)
    sparse[:, :3] = True  # 3 of 10 pages from the file: the rest are hot
    spill.evict_page_cache()
    for layer in range(L):
        spill.map_pages(layer, np.arange(H), 0, lens, dense)
    assert hinted == [] and spill._reader is None  # dense: no hint (pulled), no reader
    assert not any(_read_randomly(spill, layer) for layer in range(L))
    spill.evict_page_cache()
    spill.map_pages(2, np.arange(H), 0, lens, sparse)  # layer 2 turns sparse
    assert spill._sparse == [False, False, True, False]
    assert _read_randomly(spill, 2) and not _read_randomly(spill, 1)
    reader = spill._reader
    assert reader is not None
    reader.stop()  # drains the queue: every hint submitted
    spill._reader = None
    assert sorted(hinted) == sorted(spill._ranges(2))  # exactly its needed pages
    assert not reader._thread.is_alive()
    hinted.clear()
    for offset, length in spill._ranges(2):  # (the fake hint read nothing) now it is cached
        os.pread(spill.fd, length, offset)
    spill.map_pages(1, np.arange(H), 0, lens, dense)  # layer 2 is 1 ahead: no hint
    assert hinted == [] and spill._reader is None
    spill.map_pages(2, np.arange(H), 0, lens, dense)  # dense again: the kernel's again
    assert not _read_randomly(spill, 2) and spill._sparse == [False] * L


def test_close_joins_the_reader(tmp_path):
    s = SpillKv(tmp_path, P, D, StorageDtype.FLOAT16, "ab" * 32, n_layers=L, n_kv_heads=H,
                context_tokens=N)
    k = np.ones((8, H, D), np.float32)
    s.record(0, 0, None, k, k)
    s.evict_page_cache()
    s.map_pages(0, np.arange(H), 0, np.full(2, P), np.array([[True, False]] * H))
    thread = s._reader._thread
    s.close()
    assert not thread.is_alive() and s.fd == -1


@pytest.fixture
def pulls(monkeypatch):
    """Every (address, length, advice) the pull threads hand to madvise, then the real call."""
    calls: list[tuple[int, int, int]] = []
    real = pf.MADVISE

    def record(address, length, advice):
        calls.append((address, length, advice))
        return real(address, length, advice)

    if real is None:
        pytest.skip("no libc madvise here")
    monkeypatch.setattr(pf, "MADVISE", record)
    return calls


def _by_slab(spill, layers):
    """The pull threads' expected madvise calls per slab: each layer's ranges in order, from
    a page boundary."""
    v0 = pf.HDR_BYTES + L * H * spill.n_pages * spill.page_bytes
    out = {0: [], 1: []}
    for layer in layers:
        for offset, length in spill._ranges(layer):
            address = spill._base + offset
            a = address - address % 4096
            out[int(offset >= v0)].append((a, length + address - a, pf.MADV_POPULATE_READ))
    return out


def test_a_cold_dense_layer_and_the_cold_dense_layers_after_it_are_pulled(spill, pulls):
    lens, dense = np.full(10, P), np.ones((H, 10), bool)
    for layer in range(L):  # every layer dense (each fold reads every page)
        spill.map_pages(layer, np.arange(H), 0, lens, dense)
    spill.evict_page_cache()
    pulls.clear()
    spill.map_pages(1, np.arange(H), 0, lens, dense)  # layer 1 cold: 1, 2, 3 are pulled
    puller = spill._puller
    assert puller is not None and not puller.pending[1] and puller.pending[2:] == [True, True]
    for layer in (2, 3):
        spill.map_pages(layer, np.arange(H), 0, lens, dense)  # waits for its pull
    assert puller.pending == [False] * L
    expected = _by_slab(spill, [1, 2, 3])
    assert sorted(pulls) == sorted(expected[0] + expected[1])
    for slab in (0, 1):  # each stream walks its slab in layer order
        mine = [c for c in pulls if c in expected[slab]]
        assert mine == expected[slab]
    pulls.clear()
    spill.map_pages(1, np.arange(H), 0, lens, dense)  # cached now: nothing pulled
    assert pulls == []
    thread = puller._threads[0]
    spill.close()
    assert not thread.is_alive() and spill._puller is None


def test_sparse_layers_are_not_pulled(spill, pulls, hinted):
    lens, sparse = np.full(10, P), np.zeros((H, 10), bool)
    sparse[:, :2] = True
    spill.evict_page_cache()
    spill.map_pages(0, np.arange(H), 0, lens, sparse)
    assert pulls == [] and spill._puller is None and spill._sparse[0]


def test_a_kernel_without_populate_read_leaves_dense_layers_to_the_faults(spill, monkeypatch):
    calls = []

    def refuse(address, length, advice):
        calls.append(advice)
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(pf, "MADVISE", refuse)
    lens, dense = np.full(10, P), np.ones((H, 10), bool)
    spill.evict_page_cache()
    spill.map_pages(0, np.arange(H), 0, lens, dense)  # returns: the wait is released
    assert calls and not spill._puller.supported
    n = len(calls)
    spill.evict_page_cache()
    spill.map_pages(0, np.arange(H), 0, lens, dense)
    assert len(calls) == n  # not asked again


def test_a_one_row_store_into_a_cold_dense_layer_starts_the_pulls(spill, pulls, hinted):
    lens, dense = np.full(10, P), np.ones((H, 10), bool)
    for layer in range(L):
        spill.map_pages(layer, np.arange(H), 0, lens, dense)
    spill.evict_page_cache()
    pulls.clear()
    k = np.ones((1, H, D), np.float32)
    spill.record(2, 40, None, k, k)  # token 40: the first row of page 10 (reserved now)
    puller = spill._puller
    assert puller is not None and puller.pending == [False, False, False, True]
    expected = _by_slab(spill, [2, 3])
    spill.map_pages(3, np.arange(H), 0, lens, dense)
    assert sorted(pulls) == sorted(expected[0] + expected[1])
    assert hinted == []  # dense: no posix_fadvise
    stored = spill._k[(2 * H) * spill.n_pages + 10, :, 0]  # the row was written
    np.testing.assert_array_equal(stored.view(np.float16), np.ones(D, np.float16))


def test_one_probe_a_token_stands_for_its_later_dense_layers(spill, pulls, monkeypatch):
    """A decode token's one-row stores ask whether the page cache holds a dense layer once,
    at the first layer it writes; the later layers of that token are not asked, and wait
    for their pull when the first found the file cold."""
    lens, dense = np.full(11, P), np.ones((H, 11), bool)
    for layer in range(L):
        spill.map_pages(layer, np.arange(H), 0, lens, dense)
    asked = []
    real = spill._cold
    monkeypatch.setattr(spill, "_cold", lambda layer: asked.append(layer) or real(layer))
    k = np.ones((1, H, D), np.float32)
    for token in (40, 41):
        for layer in range(L):
            spill.record(layer, token, None, k, k)
    assert asked == [0, 0]
    spill.evict_page_cache()
    waited, n_asked = [], []
    for layer in range(L):  # layer 0 finds the file cold and pulls it; the others wait
        spill.record(layer, 42, None, k, k)
        waited.append(list(spill._puller.pending))
        n_asked.append(len(asked))
    assert asked[2] == 0 and n_asked == [n_asked[0]] * L  # asked at layer 0 only
    assert waited[0] == [False, True, True, True] and waited[-1] == [False] * L
