"""CSA/HCA: compress_block against float64; the compressed stream regenerated exactly from the
raw rows; attention over [entries of old blocks; raw window] against float64, bitwise the fold
over the gathered copy, budgeted == unbounded."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.atlas import Atlas, AtlasConfig, PageKey
from cfr_atlas.atlas.compressed import CompressedKv, attend_compressed
from cfr_atlas.ops import rope_cos_sin, rope_freqs
from cfr_atlas.ops.compress import compress_block

P, D, DV, R, G, N, B, W = 8, 24, 16, 8, 3, 90, 8, 20
RNG = np.random.default_rng(0)
RAW = RNG.standard_normal((N, D)).astype(np.float32)
GATES = RNG.standard_normal((N, D)).astype(np.float32)
NORM = (1 + 0.1 * RNG.standard_normal(D)).astype(np.float32)
FREQS = rope_freqs(R, theta=10000.0)


class _Raw:
    def __init__(self):
        self.calls = 0

    def regenerate_page(self, key: PageKey, tokens, k_out, v_out):
        self.calls += 1
        k_out[...] = RAW[tokens.start:tokens.stop]


def _entry64(b):
    x, g = RAW[b * B:(b + 1) * B].astype(np.float64), GATES[b * B:(b + 1) * B].astype(np.float64)
    a = np.exp(g - g.max(axis=0))
    e = (a * x).sum(axis=0) / a.sum(axis=0)
    e = e / np.sqrt(np.mean(e * e) + 1e-6) * NORM
    ang = b * B * FREQS
    c, s = np.cos(ang), np.sin(ang)
    r = e[D - R:].copy()
    e[D - R::2], e[D - R + 1::2] = r[0::2] * c - r[1::2] * s, r[0::2] * s + r[1::2] * c
    return e


def _streams(raw_budget, comp_budget):
    cfg = dict(page_tokens=P, head_dim=D, value_dim=DV)
    ra = Atlas(AtlasConfig(**cfg, hot_cache_bytes=raw_budget))
    ra.write_rows(0, 0, RAW[:, None], np.empty((N, 1, 0), np.float32))
    raw = (ra, _Raw())
    comp = CompressedKv(raw, lambda layer, tokens: GATES[tokens.start:tokens.stop], NORM, 1e-6,
                        FREQS, B)
    comp.raw_tokens = N
    ca = Atlas(AtlasConfig(**cfg, hot_cache_bytes=comp_budget))
    n_blocks = N // B
    ca.write_rows(0, 0, comp.entries(0, 0, 0, n_blocks)[:, None],
                  np.empty((n_blocks, 1, 0), np.float32))
    return raw, (ca, comp)


def test_compress_block_matches_float64():
    cos, sin = rope_cos_sin(np.array([2 * B]), FREQS)
    got = compress_block(RAW[2 * B:3 * B], GATES[2 * B:3 * B], NORM, 1e-6, cos[0], sin[0])
    assert np.abs(got - _entry64(2)).max() < 1e-5


def test_entries_regenerate_bitwise_under_any_budget():
    (_, _), (ca, comp) = _streams(0, 1 << 20)
    resident = comp.entries(0, 0, 0, N // B)
    (_, _), (ca0, comp0) = _streams(0, 0)
    for start in (0, P):  # a whole page of entries and the partial last one
        n = min(P, N // B - start)
        k, _ = ca0.page_rows(comp0, PageKey(0, 0, start), n)
        assert np.array_equal(k, resident[start:start + n])


@pytest.mark.parametrize("raw_budget, comp_budget", [(1 << 20, 1 << 20), (0, 0),
                                                     (2 * P * D * 4, P * D * 4)])
def test_attention_over_entries_and_window(raw_budget, comp_budget):
    q = RNG.standard_normal((3, 1, G, D)).astype(np.float32)
    full = attend_compressed(*_streams(1 << 20, 1 << 20), 0, 0, q, N, W, B)
    raw, comp = _streams(raw_budget, comp_budget)
    got = attend_compressed(raw, comp, 0, 0, q, N, W, B)
    assert np.array_equal(got, full)
    assert raw[0].telemetry().last_call.pages_skipped > 0
    for t in range(3):
        pos = N - 3 + t
        nb = max(0, (pos - W + 1) // B)
        keys = np.concatenate([np.array([_entry64(b) for b in range(nb)]).reshape(-1, D),
                               RAW[nb * B:pos + 1].astype(np.float64)])
        s = q[t, 0].astype(np.float64) @ keys.T / np.sqrt(D)
        w = np.exp(s - s.max(axis=1, keepdims=True))
        ref = w / w.sum(axis=1, keepdims=True) @ keys[:, :DV]
        assert np.abs(got[t, 0] - ref).max() < 1e-5
