"""Read-ahead of the spill page file (kv/page_file.py): which byte ranges it asks the disk for,
that it asks only for pages not cached, and that its thread ends with the file."""

from __future__ import annotations

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


def test_dense_layers_are_left_to_the_kernel_sparse_ones_are_hinted(spill, hinted):
    lens = np.full(10, P)
    dense, sparse = np.ones((H, 10), bool), np.zeros((H, 10), bool)
    sparse[:, :3] = True  # 3 of 10 pages from the file: the rest are hot
    spill.evict_page_cache()
    for layer in range(L):
        spill.map_pages(layer, np.arange(H), 0, lens, dense)
    assert hinted == [] and spill._reader is None  # dense: no hint, no thread
    assert not any(_read_randomly(spill, layer) for layer in range(L))
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
