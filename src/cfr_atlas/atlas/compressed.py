"""CSA/HCA attention (DeepSeek V4 style): a raw local window plus compressed older blocks.

Two page streams per layer, each an Atlas of its own: the raw stream (one row per token) and the
compressed stream (one entry per `block` raw tokens, entry b = ops.compress_block of raw rows
b*block .. (b+1)*block - 1, written once the block is complete). `CompressedKv` is the
compressed stream's regenerator: it rebuilds entries from the raw rows as stored (read through
the raw Atlas: resident, mapped or regenerated) and the gate logits (`gates(layer, tokens)`),
so a regenerated entry has the bits of the written one.

A query at position p reads the compressed entries of the blocks that end before
nb * block, nb = max(0, (p - window + 1) // block), and the raw rows nb * block .. p (between
`window` and window + block - 1 tokens): every token is covered exactly once. Both sets are
gathered, entries first, into one contiguous copy and folded as one dense context (softmax over
the union, `sparse.fold_gathered`). Raw pages before nb * block are never read (counted as
skipped). Exact: bitwise the fold over the gathered copy, budgeted == unbounded (either stream
under any budget). This module holds no model weights: rows, gates and norms are arguments.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas.pages import PageKey, page_count
from cfr_atlas.atlas.sparse import fold_gathered
from cfr_atlas.atlas.storage import widen
from cfr_atlas.atlas.telemetry import Counters
from cfr_atlas.errors import DimensionError
from cfr_atlas.ops import rope_cos_sin
from cfr_atlas.ops.compress import compress_block


def read_rows(atlas, backend, layer: int, head: int, a: int, b: int, context: int):
    """Stored rows a..b-1 of one stream: (K^T (D, b - a), V (b - a, Dvs)) in storage dtype,
    page by page through `Atlas.page_rows`; -> (kt, v, pages read)."""
    P = atlas.config.page_tokens
    ks, vs, pages = [], [], 0
    for g in range(a // P, page_count(b, P)):
        k, v = atlas.page_rows(backend, PageKey(layer, head, g * P), min(P, context - g * P))
        lo, hi = max(a, g * P) - g * P, min(b, (g + 1) * P) - g * P
        ks.append(k[lo:hi])
        vs.append(v[lo:hi])
        pages += 1
    return np.concatenate(ks).T, np.concatenate(vs), pages


class CompressedKv:
    """Regenerator of the compressed stream from the raw one (see the module docstring).

    raw: (atlas, regenerator) of the raw stream; gates(layer, tokens: range) -> (n, D) f32 gate
    logits; norm_w (D,), eps; freqs (R/2,) rope frequencies (an entry turns at its block's first
    token); block: raw tokens per entry. `raw_tokens`: how many raw rows the raw stream holds
    (its owner keeps it current; pages are read with exactly the rows they hold)."""

    def __init__(self, raw, gates, norm_w, eps: float, freqs: np.ndarray, block: int):
        self.raw_atlas, self.raw_backend = raw
        self.gates, self.norm_w, self.eps = gates, norm_w, eps
        self.freqs, self.block = freqs, block
        self.raw_tokens = 0

    def entries(self, layer: int, head: int, b0: int, b1: int) -> np.ndarray:
        """Entries b0..b1-1 (b1 - b0, D) f32 from the stored raw rows of complete blocks."""
        B, dtype = self.block, self.raw_atlas.config.dtype
        kt, _, _ = read_rows(self.raw_atlas, self.raw_backend, layer, head, b0 * B, b1 * B,
                             self.raw_tokens)
        rows = widen(np.ascontiguousarray(kt.T), dtype)
        gates = self.gates(layer, range(b0 * B, b1 * B))
        cos, sin = rope_cos_sin(np.arange(b0, b1, dtype=np.int64) * B, self.freqs)
        return np.stack([compress_block(rows[i * B:(i + 1) * B], gates[i * B:(i + 1) * B],
                                        self.norm_w, self.eps, cos[i], sin[i])
                         for i in range(b1 - b0)])

    def regenerate_page(self, key: PageKey, tokens: range, k_out, v_out) -> None:
        k_out[...] = self.entries(key.layer, key.kv_head, tokens.start, tokens.stop)


def attend_compressed(raw, comp, layer: int, head: int, q: np.ndarray, context: int,
                      window: int, block: int, *, scale: float | None = None) -> np.ndarray:
    """q (T, 1, G, D) f32 at positions context - T.. -> (T, 1, G, Dv) f32: each row over the
    compressed entries of its old blocks and its raw window (module docstring). raw, comp:
    (atlas, regenerator) of the two streams; the compressed one holds the complete blocks."""
    (ra, rb), (ca, cb) = raw, comp
    if q.ndim != 4 or q.shape[1] != 1 or window < 1:
        raise DimensionError(f"q must be (T, 1, G, D) and window >= 1, got {q.shape}, {window}")
    shape = ("head_dim", "value_dim", "storage_dtype")
    if any(getattr(ra.config, f) != getattr(ca.config, f) for f in shape):
        raise DimensionError(f"the two streams must share {', '.join(shape)}")
    n_tok, P = q.shape[0], ra.config.page_tokens
    scale = ra.config.query_scale() if scale is None else float(scale)
    sinks = np.full((1, q.shape[2]), np.nan, dtype=np.float32)
    out = np.empty((n_tok, 1, q.shape[2], ra.config.out_dim), dtype=np.float32)
    c = Counters(calls=1)
    for t in range(n_tok):
        pos = context - n_tok + t
        nb = max(0, (pos - window + 1) // block)
        kt, v, read = read_rows(ra, rb, layer, head, nb * block, pos + 1, context)
        c.pages_folded += read
        c.pages_skipped += page_count(context, P) - read
        if nb:
            ekt, ev, read = read_rows(ca, cb, layer, head, 0, nb, context // block)
            kt, v = np.concatenate([ekt, kt], axis=1), np.concatenate([ev, v])
            c.pages_folded += read
        out[t] = fold_gathered(ra, q[t:t + 1], kt[None], v[None], scale, 0.0, sinks)[0]
    ra.record(c)
    return out
