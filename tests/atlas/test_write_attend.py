"""`Atlas.write_attend`, the decode path: one call that stores a chunk's rows and attends over
the context they end. Whether it takes its compiled all-hot walk (`HotCache.append_walk` +
`fold.fold_hot`) or the general path, its result, the hot cache (slots, rows held, recency, the
rows' bytes), the accounting and the telemetry must be exactly those of `write_stored` followed
by `attend_heads`: every comparison here is `np.array_equal` or `==`, on every storage dtype,
with windows, softcap, ALiBi, sinks, a latent stream (V a view of K), budgets that force misses,
and a page-mapping regenerator. The walk itself is checked against a float64 reference in
test_exactness.py; here the claim is that the one call is the two calls, and that it really is
the compiled walk most of the time (counted)."""

from __future__ import annotations

import numpy as np
import pytest
from atlas_reference import cache_state, check_accounting

from cfr_atlas import Atlas, AtlasConfig, KeepAll, KeepRecent
from cfr_atlas.atlas import fold
from cfr_atlas.atlas.storage import StorageDtype
from cfr_atlas.errors import NumericError, PageError

D, P, H, G, LAYERS = 8, 4, 2, 3, 2
# chunks of a sequence: a prompt, single tokens across page ends, a short chunk, more tokens
CHUNKS = [6, 1, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 2, 1, 1]


class RowsKv:
    """A regenerator holding every row written (what a page file or a recompute gives back);
    with `maps`, it also records each `map_pages` call (the spill page file's learning)."""

    def __init__(self, k, v, maps=False):
        self.k, self.v, self.calls = k, v, []
        if maps:
            self.map_pages = self._map_pages

    def regenerate_page(self, key, tokens, k_out, v_out):
        k_out[...] = self.k[key.layer, tokens.start:tokens.stop, key.kv_head]
        v_out[...] = self.v[key.layer, tokens.start:tokens.stop, key.kv_head]

    def _map_pages(self, layer, heads, lo, lens, need):
        from cfr_atlas.atlas.runtime import MappedPages

        self.calls.append((layer, heads.tolist(), lo, lens.tolist(), need.tolist()))
        shape = need.shape
        return MappedPages(np.zeros((0, D, P), self.dtype), np.zeros((0, P, self.dv), self.dtype),
                           np.zeros(shape, np.int64), np.zeros(shape, np.uint32),
                           np.ones(shape, np.bool_))


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
@pytest.mark.parametrize("budget_pages,maps", [(None, False), (7, False), (7, True)],
                         ids=["unbounded", "budget", "budget+maps"])
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
        kv.dtype, kv.dv = StorageDtype(dtype).array_dtype, dv
    policy = KeepAll() if budget_pages is None else KeepRecent(recent_tokens=2 * P)
    compiled = []
    real = fold.fold_hot
    monkeypatch.setattr(fold, "fold_hot", lambda *a: compiled.append(1) or real(*a))
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
            assert kv_one.calls == kv_two.calls  # the mapping regenerator learnt the same
            check_accounting(one)
        start += T
    # chunks that grow a page without starting or overflowing it take the compiled walk when
    # nothing is missing
    grows = sum(1 for s, T in zip(np.cumsum([0] + CHUNKS).tolist(), CHUNKS, strict=False)
                if s % P and s % P + T <= P)
    if budget_pages is None:
        assert len(compiled) == LAYERS * grows
    else:
        assert 0 < len(compiled) < LAYERS * grows  # hot steps compiled, steps with misses not
        assert _telemetry(one)["total"]["regenerations"] > 0


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
