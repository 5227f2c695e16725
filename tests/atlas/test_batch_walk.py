"""The batched decode walk (atlas/batch_walk.py, decode_walk.hot_walks): a decode step of
several sequences makes every all-hot walk of a layer in one compiled call. Against each
sequence stepped alone (the per-sequence call), per step: the logits are np.array_equal, and
each sequence's hot cache (slots, rows held, recency, the rows' bytes, the accounting), clock
and telemetry counters (all but seconds) are ==. The sequences differ in prompt length (so
they cross page boundaries at different steps, where their own path takes over for a layer),
in budget and regenerator (recompute under a budget: misses; spill: its own mapped walk), and
the models include a sliding window; the rows' walks run side by side on the threads
(`hot_walks_parallel`) or in turn. Also: the call really made most walks, and the lists were
fetched again after a cache replaced its arrays."""

from __future__ import annotations

import numpy as np
import pytest
from atlas_reference import cache_state, check_accounting

from cfr_atlas.atlas import batch_walk, decode_walk, fold
from cfr_atlas.engine import load_model
from cfr_atlas.models.batch import BatchItem
from cfr_atlas.testing.tiny_gemma3 import write_tiny_gemma3

IDS = np.random.default_rng(11).integers(0, 256, size=64).astype(np.int64)
PAGE = 8


@pytest.fixture(scope="module", params=["llama-int8", "gemma3-float"])
def model(request, tiny_llama, tmp_path_factory):
    if request.param == "llama-int8":
        return load_model(tiny_llama, matmul="int8")
    path = tmp_path_factory.mktemp("gemma3") / "tiny-gemma3.gguf"
    return load_model(write_tiny_gemma3(path, sliding_window=12))


def _counters(session) -> dict:
    t = session.atlas.telemetry()
    total = {k: v for k, v in vars(t.total).items() if not k.endswith("seconds")}
    last = {k: v for k, v in vars(t.last_call).items() if not k.endswith("seconds")}
    return {"total": total, "last": last, "peak": t.peak_resident_bytes,
            "tick": session.atlas._tick}


def _alone(model, session, token: int) -> np.ndarray:
    """One token of one sequence through the per-sequence call (`Session.decode_attend`), not
    HotWalks: the reference the batched walks are held to."""
    step = model.net.decode_step
    step.walk_alone = False
    try:
        return model.net.forward_chunk(session, np.array([token], dtype=np.int64),
                                       all_logits=False)
    finally:
        del step.walk_alone  # the class's default again


def _pair(model, kws, tmp_path):
    made = []
    for side in ("solo", "batch"):
        made.append([model.session(**{"page_tokens": PAGE, "context_limit": 96, **kw,
                                      **({"cache_dir": tmp_path / side / str(i)}
                                         if "cache_dir" in kw else {})})
                     for i, kw in enumerate(kws)])
    return made


@pytest.mark.parametrize("side_by_side, min_pairs", [(True, None), (False, None), (True, 1)],
                         ids=["threads", "in-turn", "threads-vs-parallel-folds"])
@pytest.mark.parametrize("storage", ["float16", "float32"])
def test_batched_walks_are_each_sequence_alone(model, storage, side_by_side, min_pairs,
                                               tmp_path, monkeypatch):
    """min_pairs=1: every fold alone takes the parallel kernels (fold.walk_plan), while the
    walks side by side run each fold on one thread: the same items, the same bits."""
    c = model.config
    monkeypatch.setattr(batch_walk.HotWalks, "parallel", side_by_side)
    if min_pairs is not None:
        monkeypatch.setattr(fold, "PARALLEL_MIN_PAIRS", min_pairs)
    drivers = []
    for name in ("hot_walks", "hot_walks_parallel"):
        real_kernel = getattr(decode_walk, name)
        monkeypatch.setattr(decode_walk, name, lambda *a, _k=real_kernel, _n=name:
                            drivers.append(_n) or _k(*a))
    page = PAGE * c.head_dim * 2 * (2 if storage == "float16" else 4)
    kws = [{}, {}, {"kv_budget": 3 * page * c.n_kv_heads + 96 * c.n_layers * c.dim * 4,
                    "regenerator": "recompute"},
           {"kv_budget": 4 * page * c.n_kv_heads + 4096, "cache_dir": True}, {}]
    kws = [{**kw, "storage_dtype": storage} for kw in kws]
    solo, batch = _pair(model, kws, tmp_path)
    made, fetched = [], []
    real_run, real_lists = batch_walk.HotWalks.run, batch_walk.HotWalks._current_lists

    def run(self, *a, **k):
        ok = real_run(self, *a, **k)
        made.append((int(ok.sum()), len(ok)))
        return ok

    def lists(self):
        out = real_lists(self)
        fetched.append(self._versions)
        return out

    monkeypatch.setattr(batch_walk.HotWalks, "run", run)
    monkeypatch.setattr(batch_walk.HotWalks, "_current_lists", lists)
    try:
        for i, n in enumerate((5, 13, 21, 8, 30)):  # prompts ending at different page offsets
            for s in (solo[i], batch[i]):
                model.net.forward_chunk(s, IDS[:n], output=False)
        for step in range(20):
            toks = [int(IDS[(7 * i + step) % len(IDS)]) for i in range(len(kws))]
            got = model.net.forward_batch([BatchItem(s, np.array([t], dtype=np.int64))
                                           for s, t in zip(batch, toks, strict=True)])
            for i, (s, t) in enumerate(zip(solo, toks, strict=True)):
                want = _alone(model, s, t)
                assert np.array_equal(got[i], want), (step, i)
                assert cache_state(batch[i].atlas) == cache_state(s.atlas), (step, i)
                assert _counters(batch[i]) == _counters(s), (step, i)
                check_accounting(batch[i].atlas)
        walked = sum(m for m, _ in made)
        # the unbounded sequences' walks were batched except at page starts
        assert walked > 0.6 * 20 * c.n_layers * 2
        # caches replaced arrays while decoding (pages admitted, tables grown), and the lists
        # followed: the versions the calls ran with moved after the first step
        assert len(set(fetched[2 * c.n_layers:])) > 1
        # side by side: the parallel driver ran (sequences of even lengths); else never
        assert ("hot_walks_parallel" in drivers) == side_by_side and drivers
        assert batch[2].telemetry_summary()["pages_regenerated"] > 0
    finally:
        for s in solo + batch:
            s.close()


def test_one_sequence_and_mapping_regenerators_build_no_typed_lists(tiny_llama, tmp_path,
                                                                     monkeypatch):
    """A step of one sequence walks through HotWalks' single-member call (its layer's arrays),
    and sequences whose regenerator maps pages keep their own call: neither builds typed lists
    (their compile costs a process ~1 s)."""
    model = load_model(tiny_llama)
    built, lists, single = [], [], []
    real, real_lists = batch_walk.HotWalks.__init__, batch_walk.HotWalks._current_lists
    real_one = decode_walk.hot_walk_one
    monkeypatch.setattr(batch_walk.HotWalks, "__init__",
                        lambda self, *a: built.append(1) or real(self, *a))
    monkeypatch.setattr(batch_walk.HotWalks, "_current_lists",
                        lambda self: lists.append(1) or real_lists(self))
    monkeypatch.setattr(decode_walk, "hot_walk_one", lambda *a: single.append(1) or real_one(*a))
    spill = [model.session(page_tokens=PAGE, kv_budget=1 << 16, cache_dir=tmp_path / str(i))
             for i in range(2)]
    one = model.session(page_tokens=PAGE)
    try:
        for s in spill + [one]:
            model.net.forward_chunk(s, IDS[:9], output=False)
        model.net.forward_batch([BatchItem(s, IDS[:1]) for s in spill])
        assert not built  # no member at all
        model.net.forward_batch([BatchItem(one, IDS[:1])])
        assert built and single and not lists
        del single[:]
        model.net.forward_batch([BatchItem(s, IDS[:1]) for s in (one, spill[0])])
        assert single and not lists  # one member only
    finally:
        for s in spill + [one]:
            s.close()


def test_one_sequence_through_hot_walks_is_its_own_call(model, tmp_path):
    """A sequence decoding alone through HotWalks' single-member call (the default) against the
    same sequence through the per-sequence call: the logits np.array_equal and the cache,
    clock and counters ==, step after step, across page starts (where its own path takes
    over for a layer) and with a budget whose recompute regenerator misses."""
    c = model.config
    page = PAGE * c.head_dim * 2 * 2
    # the budget holds three pages a layer and head: walks hot up to 24 tokens, then misses
    for kw in ({}, {"kv_budget": 3 * c.n_layers * page * c.n_kv_heads
                    + 96 * c.n_layers * c.dim * 4, "regenerator": "recompute"}):
        (solo,), (walked,) = _pair(model, [kw], tmp_path)
        made: list = []  # walks the single-member call made (ok rows)
        real = decode_walk.hot_walk_one

        def one(*a, _m=made, _r=real):
            _r(*a)
            _m.append(int(a[-1].sum()))

        decode_walk.hot_walk_one = one
        try:
            for s in (solo, walked):
                model.net.forward_chunk(s, IDS[:11], output=False)
            for step in range(2 * PAGE + 3):
                t = int(IDS[(5 * step) % len(IDS)])
                got = model.net.forward_chunk(walked, np.array([t], dtype=np.int64),
                                              all_logits=False)
                want = _alone(model, solo, t)
                assert np.array_equal(got, want), (kw, step)
                assert cache_state(walked.atlas) == cache_state(solo.atlas), (kw, step)
                assert _counters(walked) == _counters(solo), (kw, step)
                check_accounting(walked.atlas)
            # most walks were the single-member call's (not at page starts, nor, under the
            # budget, past 24 tokens, where pages are regenerated)
            assert sum(made) > (2 * PAGE + 3) * c.n_layers // (4 if kw else 2), sum(made)
            if kw:
                assert walked.telemetry_summary()["pages_regenerated"] > 0
        finally:
            decode_walk.hot_walk_one = real
            solo.close()
            walked.close()


def test_a_member_whose_regenerator_refuses_leaves_the_step_alone(tiny_llama, tmp_path):
    """A member's regenerator copy that raises (recompute past the tokens it keeps inputs for)
    fails that item only: the others' logits, caches and counters are their solo runs'."""
    from cfr_atlas.errors import CapacityError

    model = load_model(tiny_llama)
    c = model.config
    page = PAGE * c.head_dim * 2 * 2
    kws = [{}, {"kv_budget": 2 * page * c.n_kv_heads + 12 * c.n_layers * c.dim * 4,
                "regenerator": "recompute", "context_limit": 12}, {}]
    solo, batch = _pair(model, [dict(kw) for kw in kws], tmp_path)
    try:
        for i, n in enumerate((5, 10, 9)):
            for s in (solo[i], batch[i]):
                model.net.forward_chunk(s, IDS[:n], output=False)
        failed = 0
        for step in range(4):
            live = [i for i in range(3) if i != 1 or not failed]
            got = model.net.forward_batch([BatchItem(batch[i], IDS[step:step + 1])
                                           for i in live])
            for i, out in zip(live, got, strict=True):
                if i == 1 and isinstance(out, Exception):
                    assert isinstance(out, CapacityError)
                    failed += 1
                    continue
                want = _alone(model, solo[i], int(IDS[step]))
                assert np.array_equal(out, want), (step, i)
                assert cache_state(batch[i].atlas) == cache_state(solo[i].atlas)
                assert _counters(batch[i]) == _counters(solo[i])
        assert failed == 1
    finally:
        for s in solo + batch:
            s.close()


def test_rows_that_name_a_non_member_or_a_member_twice_are_refused(tiny_llama):
    """The kernels trust the row indices (a row walks its member's cache with its own
    position): rows naming a sequence outside the group, or one member twice, are a
    DimensionError before any call, nothing written."""
    from cfr_atlas.errors import DimensionError

    model = load_model(tiny_llama)
    c = model.config
    sessions = [model.session(page_tokens=PAGE) for _ in range(3)]
    try:
        for s in sessions:
            model.net.forward_chunk(s, IDS[:5], output=False)
        atlases = [sessions[0].atlas, None, sessions[2].atlas]
        walks = batch_walk.HotWalks(atlases)
        walks.begin(c.n_layers)
        H, G, D = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
        dt = sessions[0].atlas.config.dtype.array_dtype
        k = np.zeros((2, H, D), dtype=dt)
        q = np.zeros((2, H, G, D), dtype=np.float32)
        out = np.zeros((2, H, G, D), dtype=np.float32)
        starts = np.full(3, 5, dtype=np.int64)
        states = [cache_state(s.atlas) for s in sessions]
        for rows in ([0, 1], [2, 2], [0, 0]):
            with pytest.raises(DimensionError, match="not a member, or one twice"):
                walks.run(0, np.array(rows, dtype=np.int64), starts, k, k.copy(), q, out)
        assert [cache_state(s.atlas) for s in sessions] == states
        ok = walks.run(0, np.array([0, 2], dtype=np.int64), starts, k, k.copy(), q, out)
        assert ok.shape == (2,)
        walks.end()
    finally:
        for s in sessions:
            s.close()
