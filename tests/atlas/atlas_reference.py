"""Test support for tests/atlas: a plain float64 reference attention, its error bound, and
small helpers (counting / failing regenerators, unbounded baselines, cache snapshots).

The reference is written as the math, one query row at a time, with no paging and no online
softmax, so it shares no code with `cfr_atlas.atlas.fold`. Nothing here is a test.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np

from cfr_atlas import Atlas, AtlasConfig, SyntheticKv
from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen

U32 = 2.0**-24  # unit roundoff of float32 (round to nearest)
U64 = 2.0**-53


def stored_rows(rows: np.ndarray, storage_dtype: str) -> np.ndarray:
    """float32 rows -> the float32 values a read sees after rounding to `storage_dtype`."""
    dt = StorageDtype(storage_dtype)
    return widen(round_rows(rows, dt), dt)


def reference_attention(q, K, V, pos, scale, *, window=None, softcap=None, alibi=None,
                        sink=None) -> np.ndarray:
    """q: (G, D), K/V: (>= pos + 1, D) -> (G, D) float64 attention of a query at `pos`.

    Keys pos - window + 1 .. pos (all of 0..pos without a window); score = scale * q.k, then
    softcap * tanh(score / softcap), then + slope * (key - pos); a sink adds exp(sink) to the
    denominator only. Everything in float64.
    """
    q = np.atleast_2d(np.asarray(q, dtype=np.float64))
    lo = 0 if window is None else max(0, pos - window + 1)
    keys = np.arange(lo, pos + 1)
    Kf, Vf = K[lo:pos + 1].astype(np.float64), V[lo:pos + 1].astype(np.float64)
    out = np.empty(q.shape, dtype=np.float64)
    slopes = np.broadcast_to(np.asarray(0.0 if alibi is None else alibi, dtype=np.float64),
                             (q.shape[0],))
    sinks = None if sink is None else np.broadcast_to(np.asarray(sink, dtype=np.float64),
                                                      (q.shape[0],))
    for g in range(q.shape[0]):
        s = (Kf @ q[g]) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        s = s + slopes[g] * (keys - pos)
        mx = s.max() if sinks is None else max(s.max(), sinks[g])
        w = np.exp(s - mx)
        z = w.sum() + (0.0 if sinks is None else math.exp(sinks[g] - mx))
        out[g] = (w @ Vf) / z
    return out


def error_bound(q, K, V, pos, scale, *, window=None, softcap=None, alibi=None,
                page_tokens=512) -> float:
    """A worst-case bound on |fold - reference| for one query (G, D) at `pos` (see docs/MATH.md).

    Scores: a float32 dot product of D terms summed in order (D sequential adds), times scale,
    then optionally divide / tanh / multiply (softcap) and multiply / add (ALiBi): each score is
    off by at most
        delta = gamma(D + 10) * (scale * sum_e |q_e K_je| + softcap + |slope| * distance).
    A perturbation of every score by at most delta moves a softmax average of rows bounded by
    Vmax by at most 2 (e^delta - 1) e^delta Vmax. Each page's float32 sum of at most
    page_tokens weighted rows (weights <= 1, rounded once) adds (page_tokens + 2) * 2**-24 *
    Vmax, the float64 fold ~(n + 16) units of 2**-53, and the final cast 2**-24 * |out|.
    """
    q = np.atleast_2d(np.asarray(q, dtype=np.float64))
    D = q.shape[1]
    lo = 0 if window is None else max(0, pos - window + 1)
    Ka, Va = np.abs(K[lo:pos + 1].astype(np.float64)), np.abs(V[lo:pos + 1].astype(np.float64))
    n = pos + 1 - lo
    k = D + 10
    gamma = k * U32 / (1 - k * U32)
    slope = 0.0 if alibi is None else float(np.max(np.abs(alibi)))
    magnitude = scale * (Ka @ np.abs(q).T).max() + (softcap or 0.0) + slope * (n - 1)
    delta = gamma * magnitude
    vmax = Va.max()
    pages = (min(page_tokens, n) + 2) * U32
    return (2 * math.expm1(delta) * math.exp(delta) + pages + 4 * (n + 16) * U64 + U32) * vmax


class CountingKv:
    """Wraps a regenerator and counts calls per page key."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: Counter = Counter()

    def regenerate_page(self, key, tokens, k_out, v_out):
        self.calls[key] += 1
        self.inner.regenerate_page(key, tokens, k_out, v_out)


class FailingKv:
    """Regenerates correctly until call number `fail_at` (0-based), which misbehaves by `mode`:
    "raise", "nan" (one K value NaN), "inf" (one V value inf) or "unwritten" (skips V)."""

    def __init__(self, inner, fail_at: int, mode: str):
        self.inner, self.fail_at, self.mode, self.calls = inner, fail_at, mode, 0
        self.failed_key = None

    def regenerate_page(self, key, tokens, k_out, v_out):
        n, self.calls = self.calls, self.calls + 1
        if n != self.fail_at:
            self.inner.regenerate_page(key, tokens, k_out, v_out)
            return
        self.failed_key = key
        if self.mode == "raise":
            raise OSError("disk went away")
        k_out[...] = self.inner.rows(key.layer, key.kv_head, tokens, 0)
        if self.mode == "unwritten":
            return
        v_out[...] = self.inner.rows(key.layer, key.kv_head, tokens, 1)
        if self.mode == "nan":
            k_out[-1, 0] = np.nan
        else:
            v_out[0, -1] = np.inf


def unbounded(page_tokens: int, head_dim: int, storage_dtype: str = "float32", **kw) -> Atlas:
    """An Atlas whose budget holds everything: the baseline every budgeted run must equal."""
    return Atlas(AtlasConfig(page_tokens=page_tokens, head_dim=head_dim,
                             hot_cache_bytes=1 << 40, admit_regenerated_pages=True,
                             storage_dtype=storage_dtype, **kw))


def synthetic(head_dim: int, n_layers: int = 2, n_kv_heads: int = 3, seed: int = 11):
    return SyntheticKv(seed, n_layers, n_kv_heads, head_dim)


def cache_state(atlas: Atlas) -> dict:
    """The logical hot-cache state: {(layer, head, page): (slot, tokens, last use, K rows,
    V rows)} plus the accounting. Comparable with == before and after a failed call."""
    cache, pages = atlas.cache, {}
    for layer_id, lay in cache.layers.items():
        for h, p in zip(*np.nonzero(lay.slot >= 0), strict=True):
            slot, n = int(lay.slot[h, p]), int(lay.tokens[h, p])
            pages[(layer_id, int(h), int(p))] = (slot, n, int(lay.last_use[h, p]),
                                                 cache.k[slot, :, :n].tobytes(),
                                                 cache.v[slot, :n].tobytes())
    per_layer = {layer_id: lay.bytes for layer_id, lay in cache.layers.items()}
    return {"pages": pages, "resident_bytes": cache.resident_bytes,
            "resident_pages": cache.resident_pages(),
            "layer_bytes": {k: v for k, v in per_layer.items() if v}}


def tables(atlas: Atlas) -> dict:
    """Copies of the raw slot / tokens tables per layer."""
    return {layer_id: (lay.slot.copy(), lay.tokens.copy())
            for layer_id, lay in atlas.cache.layers.items()}


def same_tables(before: dict, after: dict) -> bool:
    """Tables equal where both exist; entries only in `after` (a table grown by the failed call)
    must read "not resident" (slot -1, tokens 0)."""
    for layer_id, (slot_a, tok_a) in after.items():
        slot_b, tok_b = before.get(layer_id, (np.full((0, 0), -1), np.zeros((0, 0))))
        h, p = slot_b.shape
        if not (np.array_equal(slot_a[:h, :p], slot_b) and np.array_equal(tok_a[:h, :p], tok_b)):
            return False
        grown = np.ones(slot_a.shape, dtype=bool)
        grown[:h, :p] = False
        if (slot_a[grown] != -1).any() or (tok_a[grown] != 0).any():
            return False
    return set(before) <= set(after)


def check_accounting(atlas: Atlas) -> None:
    """Assert the hot-cache invariants of `HotCache` through its tables and its pool."""
    cfg, cache = atlas.config, atlas.cache
    total, held, all_slots = 0, 0, []
    for layer_id, lay in cache.layers.items():
        resident = lay.slot >= 0
        layer_bytes = int(lay.tokens[resident].sum()) * cfg.row_bytes
        assert lay.bytes == layer_bytes, (layer_id, lay.bytes, layer_bytes)
        assert lay.slots == int(resident.sum())
        assert lay.slots * cfg.page_bytes <= cache.layer_budget(layer_id)
        assert (lay.tokens[~resident] == 0).all()
        assert ((lay.tokens[resident] >= 1) & (lay.tokens[resident] <= cfg.page_tokens)).all()
        all_slots += lay.slot[resident].tolist()
        total += layer_bytes
        held += lay.slots
    assert len(set(all_slots)) == len(all_slots), "two pages share a slot"
    assert not set(all_slots) & set(cache.free), "a resident slot is on the free list"
    assert len(set(cache.free)) == len(cache.free)
    assert sorted(all_slots + cache.free) == list(range(cache.k.shape[0])), "a slot was lost"
    assert cache.resident_bytes == total and cache.held_slots == held
    assert total <= held * cfg.page_bytes <= cfg.hot_cache_bytes
    # what is allocated, measured from the arrays, never exceeds the budget
    assert cache.k.nbytes + cache.v.nbytes == cache.k.shape[0] * cfg.page_bytes
    assert cache.k.nbytes + cache.v.nbytes <= cfg.hot_cache_bytes
    tel = atlas.telemetry()
    assert tel.resident_bytes == total and tel.held_bytes == held * cfg.page_bytes
    assert tel.peak_resident_bytes >= tel.resident_bytes
    assert tel.allocated_bytes == (cache.k.nbytes + cache.v.nbytes + atlas._scratch_k.nbytes
                                   + atlas._scratch_v.nbytes + atlas._stage_k.nbytes
                                   + atlas._stage_v.nbytes)
    assert tel.peak_allocated_bytes >= tel.allocated_bytes
