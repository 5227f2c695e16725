"""The regenerator conformance sequence of docs/ADAPTERS.md, steps 1-3, as a reusable check.

`check_conformance(regen, full_rows, ...)` compares a regenerator against the rows the full
path wrote: first / middle / partial last page of every layer and K/V head, the last page at
a shorter length, pages in reverse order, then attention outputs with every row stored vs
budget 0 vs a small budget. SyntheticKv passes; regenerators that break the protocol fail.
"""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas import (
    Atlas,
    AtlasConfig,
    AttentionRequest,
    KeepAll,
    KeepRecent,
    NeverAdmit,
    PageKey,
    SyntheticKv,
)


class _Refuse:
    def regenerate_page(self, key, tokens, k_out, v_out):
        raise AssertionError(f"{key} should have been stored")


def _regenerate(regen, key: PageKey, n: int, head_dim: int):
    k = np.full((n, head_dim), np.nan, dtype=np.float32)
    v = np.full((n, head_dim), np.nan, dtype=np.float32)
    regen.regenerate_page(key, range(key.start_token, key.start_token + n), k, v)
    assert np.isfinite(k).all() and np.isfinite(v).all(), f"{key}: rows left unwritten"
    return k, v


def check_conformance(regen, full_rows, n_layers, n_kv_heads, context, page_tokens, head_dim,
                      storage_dtype="float32"):
    """full_rows(layer, kv_head) -> (K, V): (context, head_dim) float32 the full path wrote."""
    P = page_tokens
    n_pages = -(-context // P)
    assert context % P, "use a context with a partial last page"
    for layer in range(n_layers):  # step 2: rows, bitwise
        for head in range(n_kv_heads):
            K, V = full_rows(layer, head)
            for page in (0, n_pages // 2, n_pages - 1, n_pages // 2, 0):
                start = page * P
                n = min(P, context - start)
                k, v = _regenerate(regen, PageKey(layer, head, start), n, head_dim)
                assert np.array_equal(k, K[start:start + n]), (layer, head, start, "K")
                assert np.array_equal(v, V[start:start + n]), (layer, head, start, "V")
            last = (n_pages - 1) * P
            k, v = _regenerate(regen, PageKey(layer, head, last), 1, head_dim)
            assert np.array_equal(k, K[last:last + 1]) and np.array_equal(v, V[last:last + 1])
    rng = np.random.default_rng(0)
    for layer in range(n_layers):  # step 3: attention outputs, bitwise
        cfg = dict(page_tokens=P, head_dim=head_dim, storage_dtype=storage_dtype)
        stored = Atlas(AtlasConfig(**cfg, hot_cache_bytes=1 << 40))
        K, V = zip(*(full_rows(layer, h) for h in range(n_kv_heads)), strict=True)
        stored.write_rows(layer, 0, np.stack(K, axis=1), np.stack(V, axis=1), KeepAll())
        zero = Atlas(AtlasConfig(**cfg))
        small = Atlas(AtlasConfig(**cfg, hot_cache_bytes=2 * P * 2 * head_dim * 4,
                                  admit_regenerated_pages=True))
        for head in range(n_kv_heads):
            for tokens in (1, min(context, 2 * P + 1)):
                q = rng.standard_normal((tokens, 2, head_dim)).astype(np.float32)
                req = AttentionRequest(layer, head, q, context)
                want = stored.attend(_Refuse(), req, KeepAll())
                assert np.array_equal(zero.attend(regen, req, NeverAdmit()), want)
                assert np.array_equal(small.attend(regen, req, KeepRecent(P)), want)


D, P, CONTEXT = 8, 4, 23


def _full(syn):
    return lambda layer, head: syn.full(layer, head, CONTEXT)


@pytest.mark.parametrize("storage_dtype", ["float32", "bfloat16"])
def test_synthetic_kv_conforms(storage_dtype):
    syn = SyntheticKv(4, 2, 3, D)
    check_conformance(syn, _full(syn), 2, 3, CONTEXT, P, D, storage_dtype)


class _LengthDependent(SyntheticKv):
    """Wrong: scales rows by the page length (a row must not depend on n)."""

    def regenerate_page(self, key, tokens, k_out, v_out):
        super().regenerate_page(key, tokens, k_out, v_out)
        k_out *= np.float32(len(tokens) / P)


class _OneUlpOff(SyntheticKv):
    """Wrong: "close" rows, one ulp off on a page step 2 does not sample (step 3 sees it)."""

    def regenerate_page(self, key, tokens, k_out, v_out):
        super().regenerate_page(key, tokens, k_out, v_out)
        if key.start_token == 8:
            v_out[0] = np.nextafter(v_out[0], np.float32(2))


class _Stateful(SyntheticKv):
    """Wrong: remembers the previous page (rows depend on call order)."""

    prev = 0

    def regenerate_page(self, key, tokens, k_out, v_out):
        super().regenerate_page(key, tokens, k_out, v_out)
        k_out[0, 0] += np.float32(self.prev) * np.float32(2.0**-10)
        self.prev = key.start_token


@pytest.mark.parametrize("bad", [_LengthDependent, _OneUlpOff, _Stateful])
def test_nonconforming_regenerators_are_caught(bad):
    truth = SyntheticKv(4, 2, 3, D)
    with pytest.raises(AssertionError):
        check_conformance(bad(4, 2, 3, D), _full(truth), 2, 3, CONTEXT, P, D)
