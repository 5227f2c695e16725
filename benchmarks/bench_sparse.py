"""Sparse attention decode on a latent (MLA) K/V stream: cost and pages regenerated vs top_k.

    PYTHONPATH=src python benchmarks/bench_sparse.py [--tokens 8192 --steps 8] [--quick]
        [--json rows.json]

One layer's latent stream, DeepSeek-V3 geometry by default: K rows of 576 (latent 512 + rope
64), V the latent (a view of K), 16 query heads sharing it, float16 storage, 64-token pages,
a spill page file as regenerator and a hot cache of 10% of the stream's bytes holding the
newest pages (KeepRecent). Per decode step one query (the next token) attends either to every
causal token ("dense", the Atlas's page walk, cold pages read in place from the page file) or
to the top_k tokens a lightning indexer picks (ops.lightning_indexer_topk over a resident
index-key stream of 128 dims x 4 index heads; atlas/sparse.py reads only the pages holding a
selected token, in place from the page file, checksum verified). The index keys are synthetic
with locality (an AR(1) walk over positions: nearby tokens score alike, so a query's top_k
comes in runs, as attention to passages does); the fewer pages the runs touch, the more are
skipped. With independent random keys top_k >= pages selects nearly every page. Block-sparse
rows ("k blocks of 128", MiniMax-style, ops.block_select) rank the 128-token blocks by the
query heads' summed dot with each block's mean key and read the top k blocks plus the query's
own block (the means are computed once here; in a model they are a small stream of their own).

Columns: steps/s of this one layer's attention (indexer included for the sparse rows), pages
regenerated and pages skipped per step, and "exact": every step's output equals the same
selection's output with the whole stream resident (bitwise). It measures attention only, on
synthetic rows, not a model's tokens/s. Timings on a shared machine: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from cfr_atlas.atlas import Atlas, AtlasConfig, KeepRecent, StorageDtype, round_rows
from cfr_atlas.atlas.sparse import attend_selected
from cfr_atlas.kv import SpillKv
from cfr_atlas.ops import block_means, block_select, lightning_indexer_topk


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--latent", type=int, default=512)
    p.add_argument("--rope", type=int, default=64)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--page-tokens", type=int, default=64)
    p.add_argument("--top-k", default="dense,2048,512,128")
    p.add_argument("--blocks", default="16,4", help="block-sparse rows: top-k blocks")
    p.add_argument("--block", type=int, default=128, help="tokens per block (MiniMax: 128)")
    p.add_argument("--quick", action="store_true", help="a small stream, few steps (tests)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.steps, a.latent, a.rope, a.heads, a.page_tokens = 512, 2, 64, 16, 4, 16
        a.top_k, a.blocks, a.block = "dense,128,32", "4,1", 16
    return a


def _keys(a) -> np.ndarray:
    """The stream's K rows (tokens, D) f32 as stored (float16 values)."""
    rows = np.random.default_rng(0).standard_normal((a.tokens, a.latent + a.rope))
    return rows.astype(np.float16).astype(np.float32)


def _stream(a, folder, budget):
    """(atlas, page file) holding `a.tokens` latent rows; budget: hot-cache bytes."""
    D = a.latent + a.rope
    k_st = round_rows(_keys(a)[:, None], StorageDtype.FLOAT16)
    spill = SpillKv(folder, a.page_tokens, D, StorageDtype.FLOAT16, "00" * 32, n_layers=1,
                    n_kv_heads=1, context_tokens=a.tokens, value_dim=0)
    v_st = np.empty((a.tokens, 1, 0), dtype=k_st.dtype)
    spill.record(0, 0, None, k_st, v_st)
    atlas = Atlas(AtlasConfig(page_tokens=a.page_tokens, head_dim=D, value_dim=a.latent,
                              hot_cache_bytes=budget, storage_dtype="float16",
                              preallocate_hot_cache=True))
    for s in range(0, a.tokens, a.page_tokens):  # written as decode would: the newest stay hot
        atlas.write_stored(0, s, k_st[s:s + a.page_tokens], v_st[s:s + a.page_tokens],
                           KeepRecent(recent_tokens=1 << 40))
    return atlas, spill


def _step(atlas, spill, q, n, sel, scale):
    """One decode step's attention at context n: dense (sel None) or over the selection."""
    if sel is None:
        return atlas.attend_heads(spill, 0, [0], q, n, scale=scale)
    return attend_selected(atlas, spill, 0, [0], q, n, sel, scale=scale)


def _local_keys(rng, n: int, d: int, keep: float = 0.98) -> np.ndarray:
    """(n, d) index keys with locality: an AR(1) walk, k_j = keep k_(j-1) + noise, so nearby
    tokens score alike and a query's top_k comes in runs (unit variance throughout)."""
    noise = rng.standard_normal((n, d)) * np.sqrt(1 - keep * keep)
    keys = np.empty((n, d))
    keys[0] = rng.standard_normal(d)
    for j in range(1, n):
        keys[j] = keep * keys[j - 1] + noise[j]
    return keys.astype(np.float32)


def run(a, folder) -> list[dict]:
    D, n = a.latent + a.rope, a.tokens
    full = n * D * 2
    rng = np.random.default_rng(1)
    q = rng.standard_normal((a.steps, 1, 1, a.heads, D)).astype(np.float32)
    index_keys = _local_keys(rng, n, 128)
    index_q = rng.standard_normal((a.steps, 1, 4, 128)).astype(np.float32)
    w = np.ones(4, dtype=np.float32)
    scale = 1.0 / np.sqrt(D)
    small, spill = _stream(a, Path(folder) / "small", full // 10)
    whole, spill_all = _stream(a, Path(folder) / "whole", 2 * full)
    means = block_means(_keys(a), a.block)  # block-sparse rows: the mean of each block's keys

    def select(kind, k, s):
        if kind == "dense":
            return None
        if kind == "blocks":
            return block_select(q[s][0], means, n, k, a.block)
        return lightning_indexer_topk(index_q[s], w, index_keys, k)

    rows = [("dense", 0)] + [("top_k", int(k)) for k in a.top_k.split(",") if k != "dense"]
    rows += [("blocks", int(b)) for b in a.blocks.split(",") if b]
    out = []
    for kind, k in rows:
        regen = skipped = 0
        exact = True
        for s in range(a.steps):  # counters and exactness (the resident run is the reference)
            sel = select(kind, k, s)
            got = _step(small, spill, q[s], n, sel, scale)
            last = small.telemetry().last_call
            regen += last.regenerations
            skipped += last.pages_skipped
            exact &= bool(np.array_equal(got, _step(whole, spill_all, q[s], n, sel, scale)))
        t0 = time.perf_counter()  # then the timed pass: the budgeted steps alone
        for s in range(a.steps):
            _step(small, spill, q[s], n, select(kind, k, s), scale)
        seconds = time.perf_counter() - t0
        label = "dense" if kind == "dense" else str(k) if kind == "top_k" else \
            f"{k} blocks of {a.block}"
        out.append({"top_k": label, "tokens": n, "budget": "10%", "steps_per_s":
                    a.steps / seconds, "pages_regenerated": regen / a.steps,
                    "pages_skipped": skipped / a.steps, "pages": -(-n // a.page_tokens),
                    "exact": exact})
    spill.close()
    spill_all.close()
    return out


def main(argv=None) -> int:
    a = _args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows = run(a, folder)
    print(f"latent stream: {a.tokens} tokens, K {a.latent + a.rope} (V = first {a.latent}), "
          f"{a.heads} heads, pages of {a.page_tokens}, hot cache 10%, spill regenerator")
    print("| top_k | steps/s (1 layer) | pages regenerated / step | pages skipped / step | exact |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(f"| {r['top_k']} | {r['steps_per_s']:.1f} | {r['pages_regenerated']:.1f} of "
              f"{r['pages']} | {r['pages_skipped']:.1f} | {'yes' if r['exact'] else 'NO'} |")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
