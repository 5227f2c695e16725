"""Stateful test of the hot-cache accounting through the public API only.

A hypothesis state machine drives one budgeted Atlas with attend calls (any policy, context,
layer, head), write_rows (the model path), truncate, reset and failing regenerators, and checks
after every step that:
- resident bytes <= the budget, and each layer's bytes <= its layer budget;
- sum over resident pages of tokens * row_bytes == the reported resident bytes (and per layer);
- peak resident bytes >= resident bytes; no two pages share a slot;
- a failed call leaves the cache as it was (bar victims whose slot the call reused, which stay
  evicted), scratch all zeros;
- the slot pool as allocated (nbytes) never exceeds the budget;
- every successful attend is bitwise equal to an unbounded Atlas.
"""

from __future__ import annotations

import numpy as np
from atlas_reference import (
    FailingKv,
    cache_state,
    check_accounting,
    same_tables,
    tables,
    unbounded,
)
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cfr_atlas import (
    LRU,
    Atlas,
    AtlasConfig,
    AttentionRequest,
    KeepAll,
    KeepRecent,
    KeepSinksAndRecent,
    NeverAdmit,
    NumericError,
    RegeneratorError,
    SyntheticKv,
)
from cfr_atlas.atlas.storage import StorageDtype

POLICIES = st.sampled_from([NeverAdmit(), KeepAll(), LRU(), KeepRecent(6),
                            KeepSinksAndRecent(3, 5)])
D = 8


class HotCacheMachine(RuleBasedStateMachine):
    @initialize(page=st.integers(1, 5), budget_pages=st.integers(0, 10),
                layer1_pages=st.none() | st.integers(0, 6), admit=st.booleans(),
                dtype=st.sampled_from(["float32", "bfloat16"]))
    def setup(self, page, budget_pages, layer1_pages, admit, dtype):
        page_bytes = page * 2 * D * StorageDtype(dtype).itemsize
        self.atlas = Atlas(AtlasConfig(
            page_tokens=page, head_dim=D, hot_cache_bytes=budget_pages * page_bytes,
            admit_regenerated_pages=admit, storage_dtype=dtype, max_scratch_tokens=2 * page,
            layer_budgets=None if layer1_pages is None else {1: layer1_pages * page_bytes}))
        self.base = unbounded(page, D, dtype)
        self.syn = SyntheticKv(5, 2, 2, D)
        self.length = 0
        self.rng = np.random.default_rng(page)

    def _request(self, layer, head, back, tokens):
        context = max(1, self.length - back)
        q = self.rng.standard_normal((min(tokens, context), 2, D)).astype(np.float32)
        return AttentionRequest(layer, head, q, context)

    @rule(grow=st.integers(0, 7), layer=st.integers(0, 1), head=st.integers(0, 1),
          back=st.integers(0, 4), tokens=st.integers(1, 3), policy=POLICIES)
    def attend(self, grow, layer, head, back, tokens, policy):
        self.length += max(grow, 1 if self.length == 0 else 0)
        req = self._request(layer, head, back, tokens)
        got = self.atlas.attend(self.syn, req, policy)
        assert np.array_equal(got, self.base.attend(self.syn, req))
        calls = self.atlas.telemetry().last_call
        assert calls.hot_hits + calls.regenerations == calls.pages_folded

    @rule(grow=st.integers(1, 7), layer=st.integers(0, 1),
          heads=st.sampled_from([[0], [1], [1, 0]]), policy=POLICIES)
    def write_rows(self, grow, layer, heads, policy):
        tokens = range(self.length, self.length + grow)
        k = np.stack([self.syn.rows(layer, h, tokens, 0) for h in heads], axis=1)
        v = np.stack([self.syn.rows(layer, h, tokens, 1) for h in heads], axis=1)
        self.atlas.write_rows(layer, self.length, k, v, policy, kv_heads=heads)
        self.length += grow

    @rule(back=st.integers(0, 9))
    def truncate(self, back):
        self.length = max(0, self.length - back)
        self.atlas.truncate(self.length)

    @rule()
    def reset(self):
        self.atlas.reset()
        assert self.atlas.telemetry().resident_bytes == 0

    @precondition(lambda self: self.length > 0)
    @rule(layer=st.integers(0, 1), head=st.integers(0, 1), back=st.integers(0, 4),
          tokens=st.integers(1, 3), policy=POLICIES, fail_at=st.integers(0, 4),
          mode=st.sampled_from(["raise", "nan", "inf", "unwritten"]))
    def failing_attend(self, layer, head, back, tokens, policy, fail_at, mode):
        before, before_tables = cache_state(self.atlas), tables(self.atlas)
        bad = FailingKv(self.syn, fail_at, mode)
        req = self._request(layer, head, back, tokens)
        try:
            got = self.atlas.attend(bad, req, policy)
        except (RegeneratorError, NumericError) as e:
            assert bad.failed_key is not None and e.key == bad.failed_key
            after = cache_state(self.atlas)
            # restored, except victims whose slot a new page of the failed call took over
            # (the pool never grows past the budget to keep them): those stay evicted
            assert after["pages"].items() <= before["pages"].items()
            if after["pages"] == before["pages"]:
                assert after == before
                assert same_tables(before_tables, tables(self.atlas))
            assert not self.atlas._scratch_k.any() and not self.atlas._scratch_v.any()
        else:
            assert bad.failed_key is None  # fewer regenerations than fail_at: a normal call
            assert np.array_equal(got, self.base.attend(self.syn, req))

    @invariant()
    def accounting(self):
        if hasattr(self, "atlas"):
            check_accounting(self.atlas)


TestHotCache = HotCacheMachine.TestCase
TestHotCache.settings = settings(max_examples=100, stateful_step_count=30, deadline=None)
