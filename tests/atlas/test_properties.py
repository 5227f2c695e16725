"""Property tests: random shapes, budgets, policies, storage dtypes and call sequences.

One budgeted Atlas and one unbounded Atlas see the same random sequence of calls: the
sequence grows (sometimes through `write_rows`, the model path), requests go to any layer and
K/V head, at the newest context or an older one, with 1-3 query tokens and random masks.
Every output must be bitwise equal, and the hot-cache accounting must hold after every call.
"""

from __future__ import annotations

import numpy as np
from atlas_reference import check_accounting, unbounded
from hypothesis import given, settings
from hypothesis import strategies as st

from cfr_atlas import (
    LRU,
    Atlas,
    AtlasConfig,
    AttentionRequest,
    KeepAll,
    KeepRecent,
    KeepSinksAndRecent,
    NeverAdmit,
    SyntheticKv,
)
from cfr_atlas.atlas.storage import StorageDtype

POLICIES = st.one_of(
    st.just(NeverAdmit()), st.just(KeepAll()), st.just(LRU()),
    st.builds(KeepRecent, st.integers(0, 24)),
    st.builds(KeepSinksAndRecent, st.integers(0, 12), st.integers(0, 24)),
)

STEP = st.fixed_dictionaries({
    "grow": st.integers(0, 9), "write": st.booleans(), "layer": st.integers(0, 1),
    "head": st.integers(0, 2), "tokens": st.integers(1, 3), "back": st.integers(0, 6),
    "window": st.none() | st.integers(1, 14), "alibi": st.booleans(), "sink": st.booleans(),
    "softcap": st.sampled_from([None, 2.0]),
})


@st.composite
def scenarios(draw):
    page, dim = draw(st.integers(1, 8)), draw(st.sampled_from([4, 8, 12, 16]))
    dtype = draw(st.sampled_from(["float32", "float16", "bfloat16"]))
    page_bytes = page * 2 * dim * StorageDtype(dtype).itemsize
    budget_pages = draw(st.integers(0, 12))
    layer0 = draw(st.none() | st.integers(0, budget_pages))
    config = AtlasConfig(
        page_tokens=page, head_dim=dim, hot_cache_bytes=budget_pages * page_bytes,
        admit_regenerated_pages=draw(st.booleans()), storage_dtype=dtype,
        max_scratch_tokens=draw(st.integers(1, 3)) * page, split_pages=draw(st.integers(1, 4)),
        layer_budgets=None if layer0 is None else {0: layer0 * page_bytes})
    return config, draw(POLICIES), draw(st.integers(1, 3)), draw(st.lists(STEP, max_size=8))


@settings(max_examples=150, deadline=None)
@given(scenarios(), st.integers(0, 2**32 - 1))
def test_random_call_sequences_equal_unbounded(scenario, seed):
    config, policy, group, steps = scenario
    P, D = config.page_tokens, config.head_dim
    syn, rng = SyntheticKv(seed, 2, 3, D), np.random.default_rng(seed)
    atlas = Atlas(config)
    base = unbounded(P, D, config.storage_dtype, split_pages=config.split_pages)
    length = 0
    for step in steps:
        grow = max(step["grow"], 1 if length == 0 else 0)
        if step["write"] and grow:
            tokens = range(length, length + grow)
            k = np.stack([syn.rows(step["layer"], h, tokens, 0) for h in range(3)], axis=1)
            v = np.stack([syn.rows(step["layer"], h, tokens, 1) for h in range(3)], axis=1)
            atlas.write_rows(step["layer"], length, k, v, policy)
            check_accounting(atlas)
        length += grow
        context = max(1, length - step["back"])
        n_tok = min(step["tokens"], context)
        q = rng.standard_normal((n_tok, group, D)).astype(np.float32)
        req = AttentionRequest(
            step["layer"], step["head"], q, context, window=step["window"],
            softcap=step["softcap"], alibi_slope=0.125 if step["alibi"] else None,
            sink=rng.standard_normal(group).astype(np.float32) if step["sink"] else None)
        got = atlas.attend(syn, req, policy)
        assert np.array_equal(got, base.attend(syn, req)), step
        check_accounting(atlas)


@settings(max_examples=40, deadline=None)
@given(st.permutations([0, 1, 2]), st.integers(1, 3), st.integers(0, 8), st.integers(1, 40),
       st.integers(1, 3), POLICIES)
def test_attend_heads_any_order_equals_separate_calls(heads, n_heads, budget_pages, context,
                                                      group, policy):
    D, P = 8, 4
    heads = heads[:n_heads]
    syn = SyntheticKv(context, 1, 3, D)
    q = np.random.default_rng(context).standard_normal((2, n_heads, group, D)).astype(np.float32)
    atlas = Atlas(AtlasConfig(page_tokens=P, head_dim=D, hot_cache_bytes=budget_pages * P * 64,
                              admit_regenerated_pages=True))
    context = max(context, 2)
    got = atlas.attend_heads(syn, 0, heads, q, context, policy)
    check_accounting(atlas)
    base = unbounded(P, D)
    for hi, head in enumerate(heads):
        assert np.array_equal(got[:, hi], base.attend(syn, AttentionRequest(0, head, q[:, hi],
                                                                            context)))
