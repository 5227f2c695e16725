"""The one-pass expert repack and the slot prefetcher: speed only, never a bit of the logits.

The one-pass kernel (experts/repack.py) against its NumPy twin, the codec's repack (bytes
equal, rows that are not whole tiles, garbage in the slot beforehand); the f16 scale
conversion against NumPy on all 65,536 halves. The prefetcher (experts/prefetch.py): it never
takes a leased expert's slot, its loads and hits are counted, a wrong prediction costs only
time, and logits equal the all-resident run's (np.array_equal) with it on or off.
"""

from __future__ import annotations

import mmap
import time

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.experts.repack import KERNELS, half_bits_to_float_bits
from cfr_atlas.models.moe import MoeFfn
from cfr_atlas.quant import q4_0, q8_0
from cfr_atlas.quant.formats import QType
from cfr_atlas.quant.tiles import TILE_ROWS
from cfr_atlas.testing.tiny_moe import random_blocks

IDS = [5, 77, 300, 12, 40, 1000, 2000, 31, 9, 44, 4, 900, 17, 23]


@pytest.fixture(scope="module")
def base(model):
    model.net.set_experts(None)
    return model.logits(IDS, chunk_tokens=5)


def _idle(store, timeout=10.0):
    """Wait until the prefetcher has nothing queued or in flight."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with store.lock:
            p = store.prefetcher
            if not p.queue and p.loading is None:
                return
        time.sleep(0.005)
    raise AssertionError("prefetcher did not settle")


def test_half_to_float_bits_equal_numpy_for_every_half():
    h = np.arange(1 << 16, dtype=np.uint32)
    ref = h.astype(np.uint16).view(np.float16).astype(np.float32).view(np.uint32)
    assert np.array_equal(np.array([half_bits_to_float_bits(int(x)) for x in h],
                                   dtype=np.uint32), ref)


@pytest.mark.parametrize("arithmetic", ["float", "int8"])
@pytest.mark.parametrize("qtype,module", [(QType.Q4_0, q4_0), (QType.Q8_0, q8_0)])
@pytest.mark.parametrize("rows", [TILE_ROWS + 3, 2 * TILE_ROWS, 5, 3 * TILE_ROWS - 1])
def test_one_pass_repack_equals_the_codec_repack(arithmetic, qtype, module, rows):
    rng = np.random.default_rng(rows)
    cols = 96
    gate, up = random_blocks(rng, (2, rows, cols), qtype.name)
    gate[0, :2] = [0x01, 0x00]  # a subnormal scale
    up[-1, :2] = [0x00, 0x7E]  # a NaN scale with a payload
    if qtype is QType.Q4_0:  # every nibble value in both halves of a byte, in every column
        gate[:, 2:18] = (np.arange(rows * 16).reshape(rows, 16) * 7 % 256).astype(np.uint8)
    repack = module.repack if arithmetic == "float" else module.int_repack
    want = repack(np.concatenate([gate, up]))
    got = type(want)(*[np.full(x.nbytes, 0x55, dtype=np.uint8).view(x.dtype).reshape(x.shape)
                       for x in want])  # garbage: the slot's previous expert
    fits, one_pass = KERNELS[arithmetic, qtype]
    assert fits(want)
    one_pass([gate.reshape(-1), up.reshape(-1)], qtype, cols, got)
    for x, y in zip(got, want, strict=True):
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))


@pytest.mark.parametrize("arithmetic", ["float", "int8"])
@pytest.mark.parametrize("qtype,module", [(QType.Q4_0, q4_0), (QType.Q8_0, q8_0)])
def test_one_pass_repack_bytes_do_not_depend_on_the_thread_count(arithmetic, qtype, module):
    """Gate and up stacked, up starting at a row that is no multiple of 8 (the int8 copy's
    groups then start past partial ones): the same bytes on one thread and on all."""
    import numba

    gate, up = random_blocks(np.random.default_rng(7), (2, 5 * TILE_ROWS + 9, 128), qtype.name)
    repack = module.repack if arithmetic == "float" else module.int_repack
    fits, one_pass = KERNELS[arithmetic, qtype]
    both = np.concatenate([gate, up])
    got = []
    before = numba.get_num_threads()
    try:
        for n in (1, numba.config.NUMBA_NUM_THREADS):
            numba.set_num_threads(n)
            out = repack(both)
            for x in out:
                x.view(np.uint8)[...] = 0x55
            one_pass([gate.reshape(-1), up.reshape(-1)], qtype, 128, out)
            got.append(out)
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8))
               for x, y in zip(*got, strict=True))
    assert all(np.array_equal(x.view(np.uint8), y.view(np.uint8))
               for x, y in zip(got[0], repack(both), strict=True))


def test_one_pass_repack_refuses_tiles_of_another_shape():
    gate = random_blocks(np.random.default_rng(0), (1, 40, 64), "Q4_0")[0]
    want = q4_0.repack(gate)
    with pytest.raises(ValueError, match="do not fit"):
        KERNELS["float", QType.Q4_0][1]([gate.reshape(-1)], QType.Q4_0, 96, want)
    with pytest.raises(ValueError, match="not whole"):
        KERNELS["float", QType.Q4_0][1]([gate.reshape(-1)[:-1]], QType.Q4_0, 64, want)


def test_store_fills_q8_0_experts_in_one_pass_with_either_arithmetic(model, moe_file):
    assert all(all(lay.one_pass) for lay in model.net.experts.layouts)
    other = load_model(moe_file("qwen2moe"), matmul="int8")
    assert all(all(lay.one_pass) for lay in other.net.experts.layouts)


def test_a_step_asks_the_kernel_for_every_expert_it_loads_before_writing_one(model,
                                                                            monkeypatch):
    store = model.net.set_experts(2 * model.net.experts.slot_bytes)
    store.use_prefetch(False)
    events = []
    monkeypatch.setattr(store.source, "advise", lambda layer, es: events.extend(
        ("ask", layer, e) for e in es))
    write = store.write
    monkeypatch.setattr(store, "write", lambda key, slot: (events.append(("write", *key)),
                                                           write(key, slot))[1])
    list(store.experts(0, [1]))
    assert events == [("ask", 0, 1), ("write", 0, 1)]
    events.clear()
    assert [e for e, *_ in store.experts(1, [5, 2, 7])] == [2, 5, 7]  # 3 experts, 2 slots: turns
    assert events == [("ask", 1, 2), ("ask", 1, 5), ("ask", 1, 7),
                      ("write", 1, 2), ("write", 1, 5), ("write", 1, 7)]
    events.clear()
    list(store.experts(1, [7]))  # resident: nothing to read
    assert events == []
    model.net.set_experts(None)


def test_without_the_prefetcher_predictions_are_read_ahead_not_loaded(model, monkeypatch):
    store = model.net.set_experts(4 * model.net.experts.slot_bytes)
    store.use_prefetch(False)
    list(store.experts(1, [6]))
    asked = []
    monkeypatch.setattr(store.source, "advise", lambda layer, es: asked.extend(
        (layer, e) for e in es))
    list(store.experts(0, [1], ahead=np.array([2, 6])))
    assert asked == [(0, 1), (1, 2)]  # the step's load, then layer 1's 2 (6 is resident)
    assert sorted(k for k in store.key_of if k is not None) == [(0, 1), (1, 6)]
    assert store.telemetry.prefetched == 0
    list(store.experts(1, [0], ahead=np.array([3])))  # the last layer: nothing after it
    assert asked[2:] == [(1, 0)]
    model.net.set_experts(None)


def test_advice_skips_an_expert_whose_bytes_are_cached(model, monkeypatch):
    from cfr_atlas.experts import source as source_mod

    src = model.net.experts.source
    calls = []
    monkeypatch.setattr(source_mod.os, "posix_fadvise", lambda fd, off, n, how: calls.append(
        (off, n, how)))
    m = src.layers[1][0]
    page = mmap.PAGESIZE
    looked = []

    def pages_of(cached_but):  # a page map of the asked range: every page cached but one
        def look(address, length):
            looked.append((address, length))
            first = address - address % page
            n = -(-(address + length - first) // page)
            out = np.ones(n, bool)
            if cached_but is not None and first <= cached_but < first + n * page:
                out[(cached_but - first) // page] = False
            return out
        return look

    monkeypatch.setattr(source_mod, "resident_pages", pages_of(None))
    src.advise(1, [3])
    assert calls == []
    ranges = [(mm.address(3), mm.data[0].nbytes) for mm in src.layers[1]]  # its own
    assert looked == [(a, k) for a, n in ranges for k in (1, n)]  # first page, then all
    last = m.address(3) + m.data[0].nbytes - 1  # one page of expert 3's gate range dropped
    monkeypatch.setattr(source_mod, "resident_pages", pages_of(last))
    src.advise(1, [2, 3])
    assert calls == [(*m.byte_range(3), source_mod.os.POSIX_FADV_WILLNEED)]
    assert m.byte_range(3)[1] == m.data[0].nbytes


def test_a_tensor_found_cached_is_looked_at_again_when_the_kernel_drops_it(model, monkeypatch):
    """The case a tensor-wide trust got wrong: a layer found wholly cached, then its pages
    dropped (reclaim under a running model). The step's loads are still asked for (each
    expert's own pages are looked at every time), and finding a dropped page ends every
    tensor's trust, so `cached` looks again and the next layers are read ahead."""
    from cfr_atlas.experts import source as source_mod

    src = model.net.experts.source
    monkeypatch.setattr(source_mod, "resident_pages", lambda a, n: np.ones(
        -(-(a % mmap.PAGESIZE + n) // mmap.PAGESIZE), bool))
    src._warm.clear()
    assert src.cached(0) and src.cached(1)  # looked at: trusted for the next asks
    calls = []
    monkeypatch.setattr(source_mod.os, "posix_fadvise", lambda fd, off, n, how: calls.append(
        (off, n)))
    monkeypatch.setattr(source_mod, "resident_pages", lambda a, n: np.zeros(
        -(-(a % mmap.PAGESIZE + n) // mmap.PAGESIZE), bool))  # the kernel dropped them all
    assert src.cached(0)  # trusted, unlooked
    src.advise(1, [0, 3])
    assert calls == [mm.byte_range(e) for mm in src.layers[1] for e in (0, 3)]
    assert not src.cached(0)  # the trust ended with the dropped pages


def test_the_page_map_covers_each_expert_s_whole_range():
    from cfr_atlas.os_pages import resident_pages

    with open(__file__, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        a = np.frombuffer(mm, np.uint8)
        a.sum()  # read: every page cached
        pages = resident_pages(a.ctypes.data + 5, a.size - 5)
        assert pages is not None and len(pages) == -(-a.size // mmap.PAGESIZE)
        assert (pages & 1).all()
        del a
        mm.close()


def test_prefetcher_never_takes_a_leased_slot(model):
    store = model.net.set_experts(4 * model.net.experts.slot_bytes)  # 4 slots
    store.use_prefetch(True)
    for e in range(4):
        list(store.experts(0, [e]))  # fill the pool with layer 0's experts 0..3
    leased = store.slot_of[(0, 2)]
    before = [a.copy() for w in store.weights[leased] for a in w.tiles
              if isinstance(a, np.ndarray)]
    store.leases[leased] += 1
    try:
        store.prefetcher.request(1, range(8))  # more than the pool holds
        _idle(store)
    finally:
        store.leases[leased] -= 1
    assert store.key_of[leased] == (0, 2)
    after = [a for w in store.weights[leased] for a in w.tiles if isinstance(a, np.ndarray)]
    assert all(np.array_equal(x, y) for x, y in zip(before, after, strict=True))
    assert sum(k is not None and k[0] == 1 for k in store.key_of) == 3  # the other slots
    assert store.telemetry.prefetched == 3
    model.net.set_experts(None)


def test_prefetch_hits_and_unused_predictions_are_counted(model):
    store = model.net.set_experts(4 * model.net.experts.slot_bytes)
    store.use_prefetch(True)
    t = store.telemetry
    store.prefetcher.request(1, [3, 6])
    _idle(store)
    assert t.prefetched == 2 and t.prefetch_bytes_read == 2 * store.source.raw_bytes(1)
    assert t.bytes_read == t.prefetch_bytes_read and t.misses == 0
    assert [e for e, *_ in store.experts(1, [3, 5])] == [3, 5]
    assert t.prefetch_hits == 1 and t.prefetch_unused == 1  # 3 used; 6 predicted, not used
    assert t.hits == 1 and t.misses == 1 and t.prefetch_misses == 1  # 5 was not predicted
    model.net.set_experts(None)


@pytest.mark.parametrize("policy", ["lru", "frequency", "pinned"])
def test_wrong_predictions_cost_only_time(model, base, policy, monkeypatch):
    def worst(self, h):  # the experts this layer's router likes least
        logits = self.next_router.matmul(h)
        return np.unique(np.argsort(logits, axis=1, kind="stable")[:, :self.k])

    monkeypatch.setattr(MoeFfn, "_predict", worst)
    s, k = model.net.experts.slot_bytes, model.config.n_experts_used
    for budget in (s, k * s, 2 * k * s, model.net.experts.full_bytes // 2):
        store = model.net.set_experts(budget, policy, {(0, 1): 9, (1, 3): 5})
        store.use_prefetch(True)
        assert np.array_equal(model.logits(IDS, chunk_tokens=5), base), (policy, budget)
        assert np.array_equal(model.logits(IDS[:3]), base[:3])
        t = store.telemetry  # how many loads the thread got in first depends on scheduling
        assert t.prefetch_hits + t.prefetch_unused <= t.prefetched
    model.net.set_experts(None)


def test_logits_equal_with_the_prefetcher_on_and_off(model, base):
    s = model.net.experts.slot_bytes
    for budget in (s, 3 * s, model.net.experts.full_bytes // 2):
        store = model.net.set_experts(budget)
        for on in (False, True, False):
            store.use_prefetch(on)
            assert (store.prefetcher is not None) == on
            assert np.array_equal(model.logits(IDS, chunk_tokens=4), base), (budget, on)
            for n in (1, 2, 3):  # decode-sized steps
                assert np.array_equal(model.logits(IDS[:n]), base[:n])
    model.net.set_experts(None)


def test_a_layer_predicted_wrongly_stops_evicting_for_a_while(model):
    store = model.net.set_experts(4 * model.net.experts.slot_bytes)
    store.use_prefetch(True)
    for e in range(4):
        list(store.experts(0, [e]))  # a full pool: prefetching must evict
    t, loads = store.telemetry, []
    for pair in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 3), (4, 5)]:  # a token per round
        list(store.experts(0, [3]))
        before = t.prefetched
        store.prefetcher.request(1, pair)
        _idle(store)
        loads.append(t.prefetched - before)
        list(store.experts(1, [0]))  # the step uses none of the predicted experts
    assert t.prefetch_hits == 0 and t.prefetch_unused == t.prefetched
    assert loads[0] == 2 and loads[-3:] == [0, 0, 0], loads  # trust 1.0, then below 0.5
    assert store.prefetcher.trust[1] < 0.5
    model.net.set_experts(None)


def test_predictions_are_made_only_when_they_can_help(model, monkeypatch):
    from cfr_atlas.models.moe import MoeFfn

    store = model.net.set_experts(4 * model.net.experts.slot_bytes)
    made = []
    predict = MoeFfn._predict
    monkeypatch.setattr(MoeFfn, "_predict", lambda self, h: made.append(self.layer) or
                        predict(self, h))
    store.use_prefetch(False)
    monkeypatch.setattr(store.source, "cached", lambda layer: True)
    base = model.logits([5, 9, 2])
    assert made == []  # nothing to read ahead, nobody to load ahead: no prediction
    monkeypatch.setattr(store.source, "cached", lambda layer: False)
    assert np.array_equal(model.logits([5, 9, 2]), base)
    assert made == [0]  # layer 0 predicts layer 1's (the last layer has no next)
    made.clear()
    store.use_prefetch(True)
    monkeypatch.setattr(store.source, "cached", lambda layer: True)
    assert np.array_equal(model.logits([5, 9, 2]), base)
    assert made == [0]  # the prefetcher loads predictions, cached bytes or not
    model.net.set_experts(None)


def test_a_layer_is_cached_once_each_of_its_tensors_is(model):
    src = model.net.experts.source
    for layer in range(len(src.layers)):
        for m in src.layers[layer]:
            m.data.reshape(-1).view(np.uint8)[::mmap.PAGESIZE].sum()  # fault every page in
        src._warm.clear()
        assert src.cached(layer)


def test_the_prefetcher_runs_its_kernels_on_itself_alone(model, monkeypatch):
    """Its loads run beside the compute thread's kernels: one thread, so no second team of
    OpenMP workers exists (kernel_threads.py), and the compute thread's count is untouched."""
    import numba

    main_threads = numba.get_num_threads()
    if main_threads < 2:
        pytest.skip("one numba thread: nothing to tell apart")
    store = model.net.set_experts(4 * model.net.experts.slot_bytes)
    store.use_prefetch(True)
    seen = []
    write = type(store).write
    monkeypatch.setattr(type(store), "write",
                        lambda self, key, slot: seen.append(numba.get_num_threads())
                        or write(self, key, slot))
    try:
        store.prefetcher.request(1, [3, 6])
        _idle(store)
        prefetched = list(seen)  # (leaving the budget writes every expert on this thread)
    finally:
        model.net.set_experts(None)
    assert prefetched == [1, 1]
    assert numba.get_num_threads() == main_threads
