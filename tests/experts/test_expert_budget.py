"""Expert residency: any expert budget gives bitwise the logits of the all-resident run.

Budgets from one slot (experts processed in turns) through one layer's top-k to all, for each
eviction policy, chunked prefill, batched rows and decode (np.array_equal, and the decode's
logits fingerprint). Also what the store counts and allocates, its plan checks, and the
load-time refusals (host memory, formats without a kernel, budgets holding no expert).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from cfr_atlas.engine import load_model
from cfr_atlas.errors import CapacityError, ConfigError, HostMemoryError, UnsupportedQuantError
from cfr_atlas.experts import ExpertMatrix, ExpertSource, FrequencyPolicy, LruPolicy, PinnedPolicy
from cfr_atlas.experts.store import Turn

IDS = [5, 77, 300, 12, 40, 1000, 2000, 31, 9, 44, 4, 900, 17, 23]
POLICIES = ("lru", "frequency", "pinned")


@pytest.fixture(scope="module")
def base(model):
    """All-resident results: chunked prefill logits, and a greedy decode's fingerprint."""
    model.net.set_experts(None)
    logits = model.logits(IDS, chunk_tokens=5)
    model.generate(IDS, max_tokens=6)
    return logits, model.last_telemetry["logits_sha256"]


def _budgets(store, k: int) -> list[int]:
    s = store.slot_bytes
    return [s, k * s, store.full_bytes // 2]  # 1 slot (turns), one layer's top-k, half


@pytest.mark.parametrize("policy", POLICIES)
def test_logits_under_every_budget_equal_all_resident(model, base, policy):
    logits, fingerprint = base
    k, store = model.config.n_experts_used, model.net.experts
    for budget in _budgets(store, k):
        profile = {(0, 1): 9, (1, 3): 5}
        new = model.net.set_experts(budget, policy, profile)
        assert new.pool.nbytes <= budget
        assert np.array_equal(model.logits(IDS, chunk_tokens=5), logits), (policy, budget)
        model.generate(IDS, max_tokens=6)
        assert model.last_telemetry["logits_sha256"] == fingerprint, (policy, budget)
        assert model.last_telemetry["expert_misses"] > 0
    model.net.set_experts(None)


def test_one_slot_runs_in_turns_and_batches_match(model, base):
    store = model.net.set_experts(model.net.experts.slot_bytes)
    assert store.n_slots == 1
    assert np.array_equal(model.logits(IDS, chunk_tokens=1), base[0])
    assert store.telemetry.extra_turns > 0
    model.net.set_experts(None)


def test_batched_sequences_under_a_budget_equal_each_alone(model):
    """forward_batch (the server's step) runs two sequences' rows through one expert pass."""
    from cfr_atlas.models.batch import BatchItem

    a, b = np.array(IDS[:9], dtype=np.int64), np.array(IDS[4:], dtype=np.int64)
    alone = [model.logits(a)[-1], model.logits(b)[-1]]
    model.net.set_experts(3 * model.net.experts.slot_bytes, "frequency")
    sessions = [model.session(context_limit=16) for _ in range(2)]
    got = model.net.forward_batch([BatchItem(sessions[0], a), BatchItem(sessions[1], b)])
    for s in sessions:
        s.close()
    assert np.array_equal(got[0][0], alone[0]) and np.array_equal(got[1][0], alone[1])
    model.net.set_experts(None)


def test_pool_is_the_only_expert_memory_and_within_budget(model):
    store = model.net.set_experts("50%")
    model.logits(IDS)
    assert store.pool.nbytes == store.n_slots * store.slot_bytes <= store.full_bytes // 2
    for w in (w for ws in store.weights if ws for w in ws):
        for a in w.tiles:
            if isinstance(a, np.ndarray) and a.nbytes:  # (a format's empty offsets hold none)
                assert np.shares_memory(a, store.pool)  # slot views, no private copies
    t = store.telemetry
    assert t.peak_resident_bytes <= t.pool_bytes
    model.net.set_experts(None)


def test_telemetry_counts_and_a_warm_stable_step_moves_nothing(model):
    c = model.config
    store = model.net.set_experts(c.n_experts_used * c.n_layers * model.net.experts.slot_bytes)
    store.use_prefetch(False)  # every load a miss (the prefetcher's are counted apart)
    model.logits([5])  # one token: k experts per layer, all fit
    t = store.telemetry
    assert t.misses == c.n_experts_used * c.n_layers and t.hits == 0
    assert t.bytes_read == t.misses * store.source.raw_bytes(0)
    assert t.last_step_bytes_moved == t.misses * store.slot_bytes > 0
    model.logits([5])  # same routing, warm: every expert a hit
    assert t.last_step_bytes_moved == 0 and t.last_step_misses == 0
    assert t.hits == c.n_experts_used * c.n_layers
    report = t.routing_report()
    assert [sum(r["counts"]) for r in report] == [2 * c.n_experts_used] * c.n_layers
    assert all(0 < r["skew"] <= 1 for r in report)
    assert model.last_telemetry["expert_hits"] == t.hits
    store.use_prefetch(True)  # a right prediction finds its experts resident: nothing moves
    model.logits([5])
    assert t.last_step_bytes_moved == 0 and t.prefetched == 0
    model.net.set_experts(None)


def test_plan_is_validated_before_any_slot_is_written(model):
    store = model.net.set_experts(3 * model.net.experts.slot_bytes)
    before = list(store.key_of)
    bad = [Turn([0, 1], [((0, 0), 0), ((0, 1), 0)])]  # two loads into one slot
    with pytest.raises(CapacityError, match="refused"):
        store.validate(0, bad)
    with pytest.raises(CapacityError, match="refused"):
        store.validate(0, [Turn([99], [((0, 99), 1)])])  # no such expert
    with pytest.raises(CapacityError):
        list(store.experts(5, [0]))  # no such layer
    assert store.key_of == before
    model.net.set_experts(None)


def test_policies_rank_victims():
    lru, freq = LruPolicy(), FrequencyPolicy()
    lru.bind(1, 4)
    freq.bind(1, 4)
    for key in [(0, 1), (0, 2), (0, 1), (0, 3)]:
        lru.touch(key)
        freq.touch(key)
    assert lru.rank([(0, 1), (0, 2), (0, 3)])[0] == (0, 2)
    assert freq.rank([(0, 1), (0, 2), (0, 3)])[-1] == (0, 1)  # used twice: kept longest
    pin = PinnedPolicy({(0, 2): 10, (0, 3): 1}, n_pinned=1)
    pin.bind(1, 4)
    for key in [(0, 2), (0, 1)]:
        pin.touch(key)
    assert pin.rank([(0, 1), (0, 2)]) == [(0, 1), (0, 2)]  # pinned (0, 2) goes last


def test_a_policy_s_first_n_victims_are_the_head_of_its_full_order():
    rng = np.random.default_rng(3)
    keys = [(int(a), int(b)) for a in range(4) for b in range(16)]
    pols = [LruPolicy(), FrequencyPolicy(), PinnedPolicy({k: int(rng.integers(0, 5))
                                                         for k in keys}, n_pinned=20)]
    for p in pols:
        p.bind(10, 16)
    for i in rng.integers(0, len(keys), 300):
        for p in pols:
            p.touch(keys[i])
    cands = [keys[i] for i in rng.permutation(len(keys))[:50]] + [(9, 9)]  # one never used
    for p in pols:
        full = p.rank(cands)
        assert sorted(full) == sorted(cands)
        for n in (0, 1, 3, 50, 51, 80):
            assert p.rank(cands, n) == full[:n], (p.name, n)


def _victims_by_rule(store, occupant, group, done, n):
    """The victim rule stated over keys: free unleased slots in slot order, then the policy's
    rank of the unleased experts outside the turn, those of earlier turns last."""
    idle = [s for s in range(store.n_slots) if not store.leases[s]]
    free = [s for s in idle if occupant[s] is None][:n]
    slot = {occupant[s]: s for s in idle if occupant[s] is not None and occupant[s] not in group}
    ranked = store.policy.rank([k for k in slot if k not in done], n - len(free))
    ranked += store.policy.rank([k for k in slot if k in done], n - len(free) - len(ranked))
    return free + [slot[k] for k in ranked]


@pytest.mark.parametrize("policy", ["lru", "frequency", "pinned"])
def test_victims_are_the_policy_s_order_over_free_unleased_and_earlier_turns(model, policy):
    store = model.net.set_experts(6 * model.net.experts.slot_bytes, policy,
                                  {(0, 1): 5, (1, 3): 2})
    rng = np.random.default_rng(7)
    keys = [(layer, e) for layer in range(store.n_layers) for e in range(store.n_experts)]
    for _ in range(200):
        store.policy.touch(keys[rng.integers(len(keys))])
        occupant = [keys[i] if rng.random() < 0.8 else None
                    for i in rng.permutation(len(keys))[:store.n_slots]]
        occ = np.array([-1 if k is None else k[0] * store.n_experts + k[1] for k in occupant])
        store.leases[:] = rng.random(store.n_slots) < 0.2
        held = [k for k in occupant if k is not None]
        group = {held[i] for i in rng.permutation(len(held))[:rng.integers(0, 3)]}
        done = {held[i] for i in rng.permutation(len(held))[:rng.integers(0, 3)]} - group
        n = int(rng.integers(0, store.n_slots + 1))
        got = store._victims(occ, [occupant.index(k) for k in group],
                             [k[0] * store.n_experts + k[1] for k in done], n)
        assert got == _victims_by_rule(store, occupant, group, done, n)
    store.leases[:] = 0
    model.net.set_experts(None)


def test_budget_below_one_expert_is_refused(model):
    ids = np.arange(5) + 3
    before = model.logits(ids)
    with pytest.raises(ConfigError, match="smallest budget"):
        model.net.set_experts(1000)
    assert model.net.experts is not None  # a refusal keeps the previous store, working
    assert np.array_equal(model.logits(ids), before)
    model.net.set_experts(None)


def test_host_memory_is_checked_before_loading(moe_file, monkeypatch):
    import psutil

    class Tiny:
        available = 1 << 20

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tiny())
    with pytest.raises(HostMemoryError, match="expert_budget"):
        load_model(moe_file("qwen2moe"), expert_budget="50%")


def test_expert_format_without_kernel_is_refused_at_load():
    data = np.zeros((4, 8, 66), dtype=np.uint8)
    mat = ExpertMatrix("blk.0.ffn_gate_exps.weight", GGMLQuantizationType.IQ2_XXS, data, 8, 256)
    with pytest.raises(UnsupportedQuantError, match="IQ2_XXS"):
        ExpertSource([(mat, mat, mat)])


def test_the_prefetcher_is_on_by_default_only_with_a_core_of_its_own(model, monkeypatch):
    import cfr_atlas.experts.store as store_mod

    s = model.net.experts.slot_bytes
    try:
        for spare in (False, True):
            monkeypatch.setattr(store_mod, "spare_core", lambda spare=spare: spare)
            assert (model.net.set_experts(2 * s).prefetcher is not None) == spare
    finally:
        model.net.set_experts(None)


def test_spare_core_compares_the_cpus_with_numba_s_threads(monkeypatch):
    import numba

    from cfr_atlas import kernel_threads

    cpus = len(os.sched_getaffinity(0))
    assert kernel_threads.spare_core() == (cpus > numba.get_num_threads())
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(numba.get_num_threads())))
    assert not kernel_threads.spare_core()


def test_read_ahead_of_predicted_experts_is_counted_and_changes_nothing(model, base):
    k = model.config.n_experts_used
    store = model.net.set_experts(k * model.net.experts.slot_bytes)
    store.use_prefetch(True)
    assert np.array_equal(model.logits(IDS, chunk_tokens=5), base[0])
    t = store.telemetry
    # layer 0 predicts layer 1's experts, which are not resident: the thread loads them ahead
    # or, when it is not scheduled in time (a busy machine), layer 1 loads them: a prefetch miss
    assert t.prefetched + t.prefetch_misses > 0
    assert t.prefetch_hits + t.prefetch_unused <= t.prefetched
    assert t.prefetch_bytes_read == t.prefetched * store.source.raw_bytes(1)
    assert store.prefetcher is not None
    assert model.net.set_experts(None).prefetcher is None  # all resident: nothing to predict


def test_int8_arithmetic_under_a_budget_equals_its_all_resident_run(moe_file):
    model = load_model(moe_file("qwen2moe"), matmul="int8")
    base = model.logits(IDS)
    model.net.set_experts(model.net.experts.slot_bytes, "frequency")  # one slot: turns
    assert np.array_equal(model.logits(IDS, chunk_tokens=3), base)
