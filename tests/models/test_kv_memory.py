"""`kv_budget` bounds what a sequence really allocates for K/V, measured two ways.

1. From the objects: every NumPy array reachable from a live `Session` (hot-cache slot pool,
   scratch, staging, recompute's kept inputs, prefix blocks it holds, page tables), found by
   walking its attributes, sums to the telemetry's `allocated_kv_bytes` + `kv_table_bytes`,
   and `allocated_kv_bytes` (and its peak) stays within the budget: several budgets, both
   regenerators, with and without a prefix cache, after prefill and after decode.
2. From the process: tracemalloc (NumPy reports its allocations to it) while a sequence over a
   few thousand tokens is alive, at two budgets: the difference follows the budget difference.
"""

from __future__ import annotations

import collections
import mmap
import threading
import tracemalloc
import types

import numpy as np
import pytest

from cfr_atlas.engine import load_model
from cfr_atlas.errors import ConfigError
from cfr_atlas.generate import prefill
from cfr_atlas.models.session import fixed_kv_bytes

PAGE = 4
_LEAVES = (bytes, str, int, float, bool, complex, type(None), types.ModuleType, type,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, threading.Thread)


def owned_arrays(root, skip, mapped: list | None = None) -> list[np.ndarray]:
    """Every distinct ndarray buffer reachable from `root` through attributes, dicts, lists,
    tuples, sets and deques, not entering the objects in `skip` (the model's weights, the
    process-wide prefix cache, thread pools). Arrays over a memory-mapped file (the spill page
    file: page cache, not the process's allocation) go to `mapped` instead."""
    skip_ids = {id(o) for o in skip}
    seen, found, stack = set(), {}, [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or id(obj) in skip_ids or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, np.ndarray):
            while isinstance(obj.base, np.ndarray):
                obj = obj.base
            base = obj.base.obj if isinstance(obj.base, memoryview) else obj.base
            if isinstance(base, mmap.mmap):
                if mapped is not None and all(a is not obj for a in mapped):
                    mapped.append(obj)
                continue
            found[id(obj)] = obj
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple | set | frozenset | collections.deque):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return list(found.values())


def _skip(model, session) -> list:
    return [model.net, session.prefix, getattr(session.backend, "_pool", None),
            getattr(getattr(session.backend, "rest", None), "_pool", None)]


def _check(model, session, budget: int) -> dict:
    t = session.telemetry_summary()
    mapped = []
    walked = sum(a.nbytes for a in owned_arrays(session, _skip(model, session), mapped))
    assert walked == t["allocated_kv_bytes"] + t["kv_table_bytes"], t
    spill = getattr(session.backend, "rest", session.backend)  # BlockSource wraps it
    file_slabs = getattr(spill, "file_bytes", 4096) - 4096  # K and V slabs of the page file
    assert sum(a.nbytes for a in mapped) == file_slabs
    assert t["allocated_kv_bytes"] == sum(t["allocated_kv_by_category"].values())
    assert t["allocated_kv_bytes"] <= t["peak_allocated_kv_bytes"] <= budget, t
    return t


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(3).integers(0, 256, 150, dtype=np.int64)


@pytest.mark.parametrize("regen", ["spill", "recompute"])
@pytest.mark.parametrize("hot_pages", [0, 3, 40, 10_000])
@pytest.mark.parametrize("prefix", [False, True])
def test_allocated_bytes_are_the_arrays_the_session_owns(tiny_llama, tmp_path, ids, regen,
                                                         hot_pages, prefix):
    model = load_model(tiny_llama, prefix_cache=tmp_path / "prefix" if prefix else None)
    limit = len(ids) + 8
    fixed = sum(fixed_kv_bytes(model.config, regenerator=regen, page_tokens=PAGE,
                               context_limit=limit).values())
    page_bytes = PAGE * model.config.head_dim * 2 * 2  # K + V, float16 (the default storage)
    budget = fixed + hot_pages * page_bytes + 100  # not a whole number of slots on purpose
    kw = dict(kv_budget=budget, regenerator=regen, page_tokens=PAGE, cache_dir=tmp_path,
              context_limit=limit)
    want = model.logits(ids, page_tokens=PAGE)
    for run in range(2 if prefix else 1):  # with a prefix cache: a cold run, then a mapped one
        s = model.session(**kw)
        assert s.telemetry_summary()["allocated_kv_bytes"] <= budget
        logits = prefill(model.net, s, ids, chunk_tokens=7)[0]
        assert np.array_equal(logits, want[-1])
        t = _check(model, s, budget)
        if prefix and run == 1:  # recompute keeps mapped blocks: only as many as fit
            c = model.config
            block = c.n_layers * c.n_kv_heads * page_bytes + PAGE * 8
            fits = regen == "spill" or budget - fixed >= block
            assert (t["prompt_cached_tokens"] > 0) == fits, t
        for _ in range(8):  # decode
            tok = np.array([int(np.argmax(logits))], dtype=np.int64)
            logits = model.net.forward_chunk(s, tok, all_logits=False)[0]
        t = _check(model, s, budget)
        cats = t["allocated_kv_by_category"]
        # the slot pool is what the budget leaves, in whole slots (recompute may hold blocks)
        assert cats["hot_cache"] <= budget - fixed - cats["prefix_blocks"]
        if hot_pages == 10_000:  # more than the context can fill: sized to the context limit
            slots = model.config.n_layers * model.config.n_kv_heads * -(-limit // PAGE)
            assert cats["hot_cache"] == slots * page_bytes
        elif hot_pages:
            assert cats["hot_cache"] == (budget - fixed - cats["prefix_blocks"]) \
                // page_bytes * page_bytes
        assert cats["recompute_inputs"] == (limit * model.config.n_layers * model.config.dim
                                            * 4 if regen == "recompute" else 0)
        s.close()


def test_unbounded_session_counts_its_arrays_too(tiny_llama, ids):
    model = load_model(tiny_llama)
    s = model.session(page_tokens=PAGE)
    prefill(model.net, s, ids)
    _check(model, s, 1 << 40)
    s.close()


@pytest.mark.parametrize("regen", ["spill", "recompute"])
def test_budget_below_fixed_bytes_names_the_smallest(tiny_llama, tmp_path, regen):
    model = load_model(tiny_llama)
    fixed = fixed_kv_bytes(model.config, regenerator=regen, page_tokens=PAGE, context_limit=100)
    smallest = sum(fixed.values())
    with pytest.raises(ConfigError) as info:
        model.session(kv_budget=smallest - 1, regenerator=regen, page_tokens=PAGE,
                      cache_dir=tmp_path, context_limit=100)
    msg = str(info.value)
    assert f"{smallest - 1:,} bytes is below" in msg
    assert f"smallest accepted budget is {smallest:,} bytes" in msg
    for name, value in fixed.items():
        assert f"{name} {value:,}" in msg
    s = model.session(kv_budget=smallest, regenerator=regen, page_tokens=PAGE,
                      cache_dir=tmp_path, context_limit=100)  # the smallest is accepted
    assert s.telemetry_summary()["allocated_kv_by_category"]["hot_cache"] == 0
    s.close()


def test_embedding_obeys_the_budget(tiny_llama, tmp_path, ids):
    model = load_model(tiny_llama)
    want = model.embedding(ids.tolist(), page_tokens=PAGE)
    full = model.last_telemetry["allocated_kv_bytes"]
    budget = sum(fixed_kv_bytes(model.config, page_tokens=PAGE,
                                context_limit=len(ids)).values()) + 2048
    got = model.embedding(ids.tolist(), kv_budget=budget, page_tokens=PAGE, cache_dir=tmp_path)
    assert np.array_equal(got, want)
    t = model.last_telemetry
    assert t["peak_allocated_kv_bytes"] <= budget < full and t["pages_regenerated"] > 0


# --- the process ------------------------------------------------------------------------------
MIB = 1 << 20
TOL = 0.05  # of the budget difference, plus a fixed 256 KiB for the page tables and the like


def _traced_while_alive(model, ids, budget, tmp_path) -> tuple[int, int]:
    """(bytes traced while the prefilled session lives, peak during prefill), relative to before
    the session was made."""
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    s = model.session(kv_budget=budget, cache_dir=tmp_path, context_limit=len(ids),
                      storage_dtype="float32")  # 8 KiB per token: 23 MiB > the 16 MiB budget
    prefill(model.net, s, ids)
    now, peak = tracemalloc.get_traced_memory()
    assert s.telemetry_summary()["peak_allocated_kv_bytes"] <= budget
    s.close()
    return now - base, peak - base


def test_process_memory_follows_the_budget(tiny_gguf, tmp_path):
    """A 4-layer model with 8 KiB of K/V per token over 3,000 tokens (23 MiB of K/V): what the
    process holds while the sequence lives grows by the budget difference, within 5% (measured
    here: 15.29 MB for a 15.73 MB difference, the slot pool rounding down to whole slots)."""
    path = tiny_gguf(arch="llama", qtype="Q8_0", n_layers=4, dim=256, n_heads=4, n_kv_heads=4,
                     hidden_dim=256, context_length=4096)
    model = load_model(path)
    ids = np.random.default_rng(0).integers(0, 256, 3000, dtype=np.int64)
    prefill(model.net, model.session(context_limit=64), ids[:64])  # compile, warm caches
    s = model.session(kv_budget=1 * MIB, cache_dir=tmp_path, context_limit=len(ids),
                      storage_dtype="float32")  # and the budgeted path's kernels (page file,
    prefill(model.net, s, ids[:600])            # mapped fold), so no compile is traced
    s.close()
    tracemalloc.start()
    try:
        small, small_peak = _traced_while_alive(model, ids, 1 * MIB, tmp_path)
        large, large_peak = _traced_while_alive(model, ids, 16 * MIB, tmp_path)
    finally:
        tracemalloc.stop()
    assert abs((large - small) - 15 * MIB) <= TOL * 15 * MIB + 256 * 1024, (small, large)
    assert small <= 1 * MIB + 256 * 1024 and large <= 16 * MIB + 256 * 1024, (small, large)
    # the peak adds the transient fold state and activations of one 256-token chunk only
    assert large_peak - small_peak <= 15 * MIB + 4 * MIB, (small_peak, large_peak)
