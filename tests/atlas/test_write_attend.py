"""`Atlas.write_attend`, the decode path: one call that stores a chunk's rows and attends over the
context they end. Whether it takes the compiled walk (`HotCache.append_fold`: all hot, or with a
regenerator that maps pages, hot and mapped) or the general path, its result, the hot cache (slots,
rows held, recency, the rows' bytes), the accounting and the telemetry must be exactly those of
`write_stored` followed by `attend_heads`: every comparison here is `np.array_equal` or `==`, on
every storage dtype, with windows, softcap, ALiBi, sinks, a latent stream (V a view of K), budgets
that force misses, and a page-mapping regenerator. The walk itself is checked against a float64
reference in test_exactness.py; here the claim is that the one call is the two calls, and that it
really is the compiled walk most of the time (counted)."""

from __future__ import annotations

import numpy as np
import pytest
from atlas_reference import cache_state, check_accounting

from cfr_atlas import Atlas, AtlasConfig, KeepAll, KeepRecent
from cfr_atlas.atlas.hot_cache import HotCache
from cfr_atlas.atlas.storage import StorageDtype
from cfr_atlas.errors import DimensionError, NumericError, PageError

D, P, H, G, LAYERS = 8, 4, 2, 3, 2
# chunks of a sequence: a prompt, single tokens across page ends, a short chunk, more tokens
CHUNKS = [6, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1]


class RowsKv:
    """A regenerator holding every row written (what a page file or a recompute gives back);
    with `maps`, it also records each `map_pages` call (the spill page file's learning) and
    either maps nothing (maps=True: every page missing) or, with maps="pages", maps every
    page as a page file does (K^T and V slabs in the storage dtype, rows past a page's end
    zero, each page's checksum; `corrupt` (layer, head, page) gets a wrong one)."""

    def __init__(self, k, v, maps=False):
        self.k, self.v, self.calls, self.real, self.corrupt = k, v, [], maps == "pages", None
        if maps:
            self.map_pages = self._map_pages

    def regenerate_page(self, key, tokens, k_out, v_out):
        k_out[...] = self.k[key.layer, tokens.start:tokens.stop, key.kv_head]
        v_out[...] = self.v[key.layer, tokens.start:tokens.stop, key.kv_head]

    def _map_pages(self, layer, heads, lo, lens, need):
        from cfr_atlas.atlas.page_sum import page_checksum
        from cfr_atlas.atlas.runtime import MappedPages
        from cfr_atlas.atlas.storage import round_rows

        self.calls.append((layer, heads.tolist(), lo, lens.tolist(), need.tolist()))
        shape = need.shape
        if not self.real:
            return MappedPages(np.zeros((0, D, P), self.dtype),
                               np.zeros((0, P, self.dv), self.dtype), np.zeros(shape, np.int64),
                               np.zeros(shape, np.uint32), np.ones(shape, np.bool_))
        k_sl = np.zeros((need.size, D, P), self.dtype)
        v_sl = np.zeros((need.size, P, self.dv), self.dtype)
        slot = np.arange(need.size, dtype=np.int64).reshape(shape)
        expect = np.zeros(shape, np.uint32)
        for i, h in enumerate(heads.tolist()):
            for j, n in enumerate(lens.tolist()):
                s, a = slot[i, j], (lo + j) * P
                k_sl[s, :, :n] = round_rows(self.k[layer, a:a + n, h], self.storage).T
                v_sl[s, :n] = round_rows(self.v[layer, a:a + n, h], self.storage)
                expect[i, j] = page_checksum(k_sl[s], v_sl[s]) + (
                    self.corrupt == (layer, h, lo + j))
        return MappedPages(k_sl, v_sl, slot, expect, np.zeros(shape, np.bool_))


def _atlas(dtype: str, budget_pages: int | None, latent: bool) -> Atlas:
    kw = {"value_dim": D - 2} if latent else {}
    probe = AtlasConfig(page_tokens=P, head_dim=D, storage_dtype=dtype, **kw)
    budget = 1 << 40 if budget_pages is None else budget_pages * probe.page_bytes
    return Atlas(AtlasConfig(page_tokens=P, head_dim=D, storage_dtype=dtype,
                             hot_cache_bytes=budget, admit_regenerated_pages=True, **kw))


def _telemetry(atlas: Atlas) -> dict:
    t = atlas.telemetry()
    counters = {k: v for k, v in vars(t.total).items() if not k.endswith("seconds")}
    return {"total": counters, "peak": t.peak_resident_bytes, "held": t.held_bytes,
            "allocated": t.allocated_bytes, "pages": t.resident_pages}


SCORES = {
    "plain": {},
    "window": {"window": 6},
    "scale+softcap+alibi+sinks": {"scale": 0.3, "softcap": 4.0,
                                  "alibi": np.linspace(0.1, 0.6, H * G, dtype=np.float32
                                                       ).reshape(H, G),
                                  "sinks": np.full((H, G), 0.5, dtype=np.float32)},
}


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("score", list(SCORES))
@pytest.mark.parametrize("latent", [False, True], ids=["kv", "latent"])
@pytest.mark.parametrize("budget_pages,maps", [(None, False), (7, False), (7, True),
                                               (7, "pages"), (1, "pages"), (0, "pages")],
                         ids=["unbounded", "budget", "budget+maps", "budget+mapped",
                              "one-page+mapped", "nothing-hot+mapped"])
def test_write_attend_is_write_then_attend(dtype, score, latent, budget_pages, maps, monkeypatch):
    opts = SCORES[score]
    rng = np.random.default_rng(5)
    n = sum(CHUNKS)
    dv = 0 if latent else D
    k = rng.standard_normal((LAYERS, n, H, D)).astype(np.float32)
    v = rng.standard_normal((LAYERS, n, H, dv)).astype(np.float32)
    q = rng.standard_normal((LAYERS, n, H, G, D)).astype(np.float32)
    one, two = _atlas(dtype, budget_pages, latent), _atlas(dtype, budget_pages, latent)
    kv_one, kv_two = RowsKv(k, v, maps), RowsKv(k, v, maps)
    for kv in (kv_one, kv_two):
        kv.dtype, kv.dv, kv.storage = StorageDtype(dtype).array_dtype, dv, StorageDtype(dtype)
    policy = KeepAll() if budget_pages is None else KeepRecent(recent_tokens=2 * P)
    compiled, walks = [], []  # compiled walks: all hot, and with mapped pages
    real_walk = HotCache.append_fold

    def append_fold(*a):
        res = real_walk(*a)
        if res[0] >= 0:
            (walks if res[1] else compiled).append(1)
        return res

    monkeypatch.setattr(HotCache, "append_fold", append_fold)
    start = 0
    for T in CHUNKS:
        for layer in range(LAYERS):
            rows = slice(start, start + T)
            k_st, v_st = one.stored_rows(start, k[layer, rows], v[layer, rows])
            before = len(compiled)
            got = one.write_attend(kv_one, layer, start, k_st, v_st, q[layer, rows], policy,
                                   **opts)
            two.write_stored(layer, start, k_st, v_st, policy)
            want = two.attend_heads(kv_two, layer, range(H), q[layer, rows], start + T, policy,
                                    **opts)
            assert got.shape == want.shape == (T, H, G, D - 2 if latent else D)
            assert np.array_equal(got, want), (start, layer, len(compiled) > before)
            assert cache_state(one) == cache_state(two), (start, layer)
            assert _telemetry(one) == _telemetry(two), (start, layer)
            # the mapping regenerator learnt the same (a regenerator that cannot map the
            # walk's pages is asked once by the walk and once more by the general path)
            assert _once(kv_one.calls) == kv_two.calls
            check_accounting(one)
        start += T
    # chunks that grow a page without starting or overflowing it take the compiled walk when
    # nothing is missing
    grows = sum(1 for s, T in zip(np.cumsum([0] + CHUNKS).tolist(), CHUNKS, strict=False)
                if s % P and s % P + T <= P)
    if budget_pages is None:
        assert len(compiled) == LAYERS * grows and not walks
    elif maps == "pages":  # steps with misses take the mapped walk
        assert len(walks) > 0 and len(compiled) + len(walks) > LAYERS * grows // 2
        assert _telemetry(one)["total"]["bytes_mapped"] > 0
    else:
        assert 0 < len(compiled) < LAYERS * grows  # hot steps compiled, steps with misses not
        assert not walks and _telemetry(one)["total"]["regenerations"] > 0


def _once(calls: list) -> list:
    """`calls` with each run of equal consecutive calls counted once."""
    return [c for i, c in enumerate(calls) if i == 0 or c != calls[i - 1]]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_a_mapped_page_failing_its_check_raises_as_the_two_calls_do(dtype):
    """The mapped walk checks every mapped page in the fold: a wrong checksum raises
    CorruptPageError naming the page, after the write, and the hot cache and telemetry are
    those of write_stored followed by the attend call that raised."""
    from cfr_atlas.errors import CorruptPageError

    rng = np.random.default_rng(9)
    n = 4 * P + 1
    k = rng.standard_normal((LAYERS, n + 2 * P, H, D)).astype(np.float32)
    v = rng.standard_normal((LAYERS, n + 2 * P, H, D)).astype(np.float32)
    q = rng.standard_normal((1, H, G, D)).astype(np.float32)
    one, two = _atlas(dtype, 3, False), _atlas(dtype, 3, False)
    kvs = RowsKv(k, v, "pages"), RowsKv(k, v, "pages")
    policy = KeepRecent(recent_tokens=P)
    for atlas, kv in zip((one, two), kvs, strict=True):
        kv.dtype, kv.dv, kv.storage = StorageDtype(dtype).array_dtype, D, StorageDtype(dtype)
        for t in range(n):  # one token at a time: page 0.. leave the hot cache as they age
            k_st, v_st = atlas.stored_rows(t, k[0, t:t + 1], v[0, t:t + 1])
            atlas.write_attend(kv, 0, t, k_st, v_st, q, policy)
        kv.corrupt = (0, 1, 1)
    k_st, v_st = one.stored_rows(n, k[0, n:n + 1], v[0, n:n + 1])
    walks = []
    real_walk = HotCache.append_fold
    HotCache.append_fold = lambda *a: walks.append(real_walk(*a)) or walks[-1]
    try:
        with pytest.raises(CorruptPageError, match="checksum mismatch"):
            one.write_attend(kvs[0], 0, n, k_st, v_st, q, policy)
    finally:
        HotCache.append_fold = real_walk
    assert walks and walks[-1][2] == 1  # the mapped walk found it
    two.write_stored(0, n, k_st, v_st, policy)
    with pytest.raises(CorruptPageError, match="checksum mismatch"):
        two.attend_heads(kvs[1], 0, range(H), q, n + 1, policy)
    assert cache_state(one) == cache_state(two)
    assert _telemetry(one) == _telemetry(two)
    last = [{k: v for k, v in vars(a.telemetry().last_call).items() if "seconds" not in k}
            for a in (one, two)]
    assert last[0] == last[1]
    # and the atlases go on alike (the free slots in the same order): the next tokens
    kvs[0].corrupt = kvs[1].corrupt = None
    for t in range(n + 1, n + 2 * P):
        k_st, v_st = one.stored_rows(t, k[0, t:t + 1], v[0, t:t + 1])
        got = one.write_attend(kvs[0], 0, t, k_st, v_st, q, policy)
        two.write_stored(0, t, k_st, v_st, policy)
        assert np.array_equal(got, two.attend_heads(kvs[1], 0, range(H), q, t + 1, policy))
        assert cache_state(one) == cache_state(two)


def test_a_decode_walk_that_finds_a_bad_page_leaves_no_result_in_out():
    """out, handed to the compiled walk, holds NaN after a mapped page fails its check (not
    attention over the damaged page)."""
    from cfr_atlas.errors import CorruptPageError

    rng = np.random.default_rng(4)
    n = 2 * P + 1
    k = rng.standard_normal((LAYERS, n + 1, H, D)).astype(np.float32)
    v = rng.standard_normal((LAYERS, n + 1, H, D)).astype(np.float32)
    q = rng.standard_normal((1, H, G, D)).astype(np.float32)
    atlas, kv = _atlas("float16", 1, False), RowsKv(k, v, "pages")
    kv.dtype, kv.dv, kv.storage = np.uint16, D, StorageDtype.FLOAT16
    policy = KeepRecent(recent_tokens=P)
    for t in range(n):
        k_st, v_st = atlas.stored_rows(t, k[0, t:t + 1], v[0, t:t + 1])
        atlas.write_attend(kv, 0, t, k_st, v_st, q, policy)
    kv.corrupt = (0, 1, 0)
    k_st, v_st = atlas.stored_rows(n, k[0, n:n + 1], v[0, n:n + 1])
    out = np.zeros((1, H, G, D), np.float32)
    with pytest.raises(CorruptPageError, match="checksum mismatch"):
        assert atlas.decode_attend(kv, 0, n, k_st, v_st, q, out) is not None
    assert np.isnan(out).all()


def _two_atlases_five_rows_in(seed: int):
    """Two float16 Atlases holding the same 5 rows of layer 0, a query, and the 6th token's
    rows stored (k_st, v_st) but not yet written."""
    one, two = _atlas("float16", None, False), _atlas("float16", None, False)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((6, H, D)).astype(np.float32)
    v = rng.standard_normal((6, H, D)).astype(np.float32)
    q = rng.standard_normal((1, H, G, D)).astype(np.float32)
    for atlas in (one, two):
        k_st, v_st = atlas.stored_rows(0, k[:5], v[:5])
        atlas.write_stored(0, 0, k_st, v_st)
    k_st, v_st = one.stored_rows(5, k[5:], v[5:])
    return one, two, q, k_st, v_st


def test_errors_leave_the_state_of_the_two_calls():
    """An argument the attention refuses is refused after the write, as by the two calls."""
    one, two, q, k_st, v_st = _two_atlases_five_rows_in(1)
    bad = q.copy()
    bad[0, 1, 2, 3] = np.nan
    for query, opts, error in ((bad, {}, NumericError), (q, {"scale": -1.0}, NumericError),
                               (q, {"window": 0}, PageError)):
        with pytest.raises(error):
            one.write_attend(RowsKv(None, None), 0, 5, k_st, v_st, query, None, **opts)
        two.write_stored(0, 5, k_st, v_st)
        with pytest.raises(error):
            two.attend_heads(RowsKv(None, None), 0, range(H), query, 6, **opts)
        assert cache_state(one) == cache_state(two)
        assert _telemetry(one) == _telemetry(two)


def test_rows_of_no_head_are_refused():
    """write_stored of rows for zero K/V heads is a DimensionError, nothing written."""
    one, two, _, k_st, v_st = _two_atlases_five_rows_in(2)
    for heads in ([], None):
        with pytest.raises(DimensionError, match="at least one"):
            one.write_stored(0, 5, k_st[:, :0], v_st[:, :0], kv_heads=heads)
    assert cache_state(one) == cache_state(two)


def test_a_regenerator_refusing_the_walk_leaves_the_state_of_the_two_calls():
    """A `map_pages` that raises (a page file gone) takes the two general calls: the rows are
    written, then the attention raises, as write_stored then attend_heads do."""
    from cfr_atlas.errors import CorruptPageError

    class Refusing(RowsKv):
        def _map_pages(self, *a):
            raise CorruptPageError("page file gone")

    one, two, q, k_st, v_st = _two_atlases_five_rows_in(2)
    with pytest.raises(CorruptPageError):
        one.write_attend(Refusing(None, None, maps=True), 0, 5, k_st, v_st, q, None)
    two.write_stored(0, 5, k_st, v_st)
    with pytest.raises(CorruptPageError):
        two.attend_heads(Refusing(None, None, maps=True), 0, range(H), q, 6)
    assert cache_state(one) == cache_state(two)
    assert _telemetry(one) == _telemetry(two)
