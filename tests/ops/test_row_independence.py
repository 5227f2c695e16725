"""Every op on the batched row path gives each row the same bits whatever rows share the call:
rms_norm, swiglu, the RoPE tables and rotation, embedding rows and the quantized matmul. This
is what lets `forward_batch` concatenate the rows of many sequences (tests/models/
test_forward_batch.py checks the whole pass)."""

from __future__ import annotations

import numpy as np
import pytest

from cfr_atlas.ops import rms_norm, rope_cos_sin, rope_freqs, rotate, swiglu
from cfr_atlas.quant import QuantWeight
from cfr_atlas.quant.formats import QType, row_bytes

CUTS = [(0, 1), (1, 2), (3, 10), (10, 41), (0, 41), (40, 41)]


def _rows(rng, n=41, d=96):
    return (rng.standard_normal((n, d)) * rng.uniform(0.1, 30, (n, 1))).astype(np.float32)


@pytest.mark.parametrize("a,b", CUTS)
def test_rms_norm_and_swiglu_rows(a, b):
    rng = np.random.default_rng(0)
    x, w = _rows(rng), rng.standard_normal(96).astype(np.float32)
    assert np.array_equal(rms_norm(x, w, 1e-5)[a:b], rms_norm(x[a:b].copy(), w, 1e-5))
    g, u = _rows(rng), _rows(rng)
    assert np.array_equal(swiglu(g, u)[a:b], swiglu(g[a:b].copy(), u[a:b].copy()))


@pytest.mark.parametrize("mode", ["normal", "neox"])
def test_rope_tables_and_rotation_rows(mode):
    """Positions of several sequences concatenated (as a batch has them) vs each alone."""
    rng = np.random.default_rng(1)
    freqs = rope_freqs(32, theta=10000.0)
    parts = [np.arange(p, p + n, dtype=np.int64) for p, n in
             ((0, 37), (5000, 1), (12, 64), (131071, 3), (7, 1))]
    cos, sin = rope_cos_sin(np.concatenate(parts), freqs)
    x = rng.standard_normal((cos.shape[0], 4, 32)).astype(np.float32)
    y = rotate(x, cos, sin, mode=mode)
    a = 0
    for p in parts:
        c1, s1 = rope_cos_sin(p, freqs)
        b = a + len(p)
        assert np.array_equal(cos[a:b], c1) and np.array_equal(sin[a:b], s1)
        assert np.array_equal(y[a:b], rotate(x[a:b].copy(), c1, s1, mode=mode))
        a = b


@pytest.mark.parametrize("qtype", [QType.Q8_0, QType.Q4_0, QType.Q4_1])
def test_embedding_rows_and_matmul_rows(qtype):
    rng = np.random.default_rng(2)
    n, k = 72, 128
    nb = k // 32
    raw = rng.integers(0, 256, (n, nb, row_bytes(qtype, k) // nb), dtype=np.uint8)
    head = 4 if qtype is QType.Q4_1 else 2  # float16 scale (and Q4_1's min) open each block
    raw[:, :, :head] = np.frombuffer(np.float16(0.01).tobytes() * (head // 2), np.uint8)
    w = QuantWeight.from_raw("w", qtype, raw.reshape(n, -1), (n, k))
    ids = rng.integers(0, n, 41)
    table = w.rows(ids)
    x = _rows(rng, 41, k)
    y = w.matmul(x)
    for a, b in CUTS:
        assert np.array_equal(table[a:b], w.rows(ids[a:b]))
        assert np.array_equal(y[a:b], w.matmul(x[a:b].copy()))
    assert all(np.array_equal(y[t], w.matvec(x[t].copy())) for t in range(41))
