"""The spill page file (kv/page_file.py): rows stored in place through the mapping, page
checksums kept current through appends and rewinds, and every misuse a typed error."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.atlas import PageKey
from cfr_atlas.atlas.page_sum import page_checksum_numpy
from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen
from cfr_atlas.errors import CapacityError, CorruptPageError
from cfr_atlas.kv import SpillKv

P, D, L, H, N = 4, 6, 2, 2, 12


@pytest.fixture(params=list(StorageDtype), ids=lambda d: d.value)
def spill(request, tmp_path):
    s = SpillKv(tmp_path, P, D, request.param, "ab" * 32, n_layers=L, n_kv_heads=H,
                context_tokens=N)
    yield s
    s.close()


def _rows(rng, T):
    return (rng.standard_normal((T, H, D)).astype(np.float32) for _ in range(2))


def _read(spill, layer, head, start, n):
    k, v = np.empty((n, D), np.float32), np.empty((n, D), np.float32)
    spill.regenerate_page(PageKey(layer, head, start), range(start, start + n), k, v)
    return k, v


def _check_sums(spill):
    for s in np.flatnonzero(spill.tokens):
        assert int(spill.sums[s]) == page_checksum_numpy(spill._k[s], spill._v[s])


def test_rows_read_back_exactly_through_appends_and_a_rewind(spill):
    rng = np.random.default_rng(0)
    k, v = _rows(rng, 10)
    for a, b in ((0, 3), (3, 4), (4, 10)):  # a chunk, one token, a chunk across pages
        spill.record(1, a, None, k[a:b], v[a:b])
    _check_sums(spill)
    k2, v2 = _rows(rng, 3)  # rewind: tokens 5.. are written again
    spill.record(1, 5, None, k2, v2)
    _check_sums(spill)
    want_k = np.concatenate([k[:5], k2])
    want_v = np.concatenate([v[:5], v2])
    got_k, got_v = _read(spill, 1, 1, 4, 4)
    assert np.array_equal(got_k, widen(round_rows(want_k[4:8, 1], spill.dtype), spill.dtype))
    assert np.array_equal(got_v, widen(round_rows(want_v[4:8, 1], spill.dtype), spill.dtype))
    # page 2 keeps its old rows until token 8 is written again, which clears them first
    assert spill.tokens.reshape(L, H, -1)[1, 0].tolist() == [4, 4, 2]
    k3, v3 = _rows(rng, 1)
    spill.record(1, 8, None, k3, v3)
    assert spill.tokens.reshape(L, H, -1)[1, 0].tolist() == [4, 4, 1]
    _check_sums(spill)


def test_gaps_overflow_and_missing_pages_are_typed_errors(spill):
    rng = np.random.default_rng(1)
    k, v = _rows(rng, 2)
    spill.record(0, 0, None, k, v)
    with pytest.raises(CorruptPageError, match="appended in order"):
        spill.record(0, 3, None, k[:1], v[:1])   # token 2 never written
    with pytest.raises(CapacityError, match="context limit"):
        spill.record(0, N - 1, None, k, v)       # past the tokens the file holds
    with pytest.raises(CorruptPageError, match="rows"):
        _read(spill, 0, 0, 0, 3)                 # the page holds 2 rows, not 3


def test_damage_through_the_file_is_caught_on_read(spill):
    rng = np.random.default_rng(2)
    k, v = _rows(rng, 4)
    spill.record(0, 0, None, k, v)
    spill.evict_page_cache()                     # written back, dropped: read from the file
    _read(spill, 0, 1, 0, 4)
    with open(spill.path, "r+b") as f:
        f.seek(spill.file_bytes - len(spill.tokens) * spill.page_bytes + 3)  # a V byte, slot 0
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x08]))
    with pytest.raises(CorruptPageError, match="checksum"):
        _read(spill, 0, 0, 0, 4)
    with open(spill.path, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptPageError, match="truncated"):
        _read(spill, 0, 1, 0, 4)


def test_file_is_sparse_until_written_and_removed_on_close(tmp_path):
    s = SpillKv(tmp_path, 256, 64, StorageDtype.FLOAT16, "ab" * 32, n_layers=30, n_kv_heads=3,
                context_tokens=8192)
    assert s.file_bytes == 4096 + 30 * 3 * 8192 * 23040 // 90   # 23,040 bytes per token
    assert s.path.stat().st_blocks * 512 < 1 << 20               # nothing allocated yet
    s.record(0, 0, None, np.ones((1, 3, 64), np.float32), np.ones((1, 3, 64), np.float32))
    assert s.path.stat().st_blocks * 512 >= 3 * 2 * 256 * 64 * 2  # one page per head, K and V
    s.close()
    assert not s.path.exists()


def test_heads_in_any_order_map_their_own_pages_and_outsiders_are_refused(spill):
    rng = np.random.default_rng(4)
    k, v = _rows(rng, 6)
    spill.record(0, 0, None, k, v)
    lens = np.array([4, 2])
    need = np.ones((2, 2), dtype=bool)
    forward = spill.map_pages(0, np.array([0, 1]), 0, lens, need)
    swapped = spill.map_pages(0, np.array([1, 0]), 0, lens, need)
    assert np.array_equal(swapped.slot, forward.slot[::-1])
    assert np.array_equal(swapped.expect, forward.expect[::-1])
    with pytest.raises(CorruptPageError, match="outside"):
        spill.map_pages(0, np.array([0, H]), 0, lens, need)
    with pytest.raises(CorruptPageError, match="outside"):
        _read(spill, L, 0, 0, 4)
