"""`RecomputeKv`: regenerate K/V pages by replaying the model's K/V projection exactly.

What is kept: each layer's input rows x (the residual stream entering the layer), float32,
`n_layers * dim * 4` bytes per token. From x the regenerator replays exactly what the forward
pass did for K and V — RMSNorm, the K/V rows of the projection (+ bias), RoPE at the page's
positions — with the same batch-invariant kernels, so the rows are bitwise identical whatever
chunking produced them. The projection uses per-head K/V weights cut from the GGUF rows at load
(each output row of a quantized matmul is computed independently, so a row subset gives the
same bits as the fused Q|K|V matrix; tests check it).

Memory, honestly: K/V costs `2 * n_layers * n_kv_heads * head_dim * 4` bytes per token. The kept
input costs `n_layers * dim * 4`. That saves memory only when 2 * n_kv_heads * head_dim < dim,
i.e. for multi-head models (Llama-2-7B: 8,192 vs 4,096 floats per layer, 2x saved). For GQA
models it costs more (SmolLM2-135M: 384 vs 576 floats, 1.5x more): use `spill` there.
"""

from __future__ import annotations

import numpy as np

from cfr_atlas.atlas.pages import PageKey
from cfr_atlas.errors import CapacityError, CorruptPageError
from cfr_atlas.quant import QuantWeight


def kv_head_weights(gf, cfg, layer: int,
                    matmul: str = "float") -> list[tuple[QuantWeight, np.ndarray | None]]:
    """Per K/V head: a weight over [K rows of the head; V rows of the head] and its bias, in the
    model's matmul arithmetic (a recompute must replay the very kernels of the forward pass)."""
    hd, out = cfg.head_dim, []
    tk, tv = gf.tensor(f"blk.{layer}.attn_k.weight"), gf.tensor(f"blk.{layer}.attn_v.weight")
    rk = np.asarray(tk.data).reshape(int(tk.shape[1]), -1)
    rv = np.asarray(tv.data).reshape(int(tv.shape[1]), -1)
    bias = None
    if cfg.qkv_bias:
        bias = (gf.tensor_f32(f"blk.{layer}.attn_k.bias"),
                gf.tensor_f32(f"blk.{layer}.attn_v.bias"))
    for h in range(cfg.n_kv_heads):
        rows = slice(h * hd, (h + 1) * hd)
        if tk.tensor_type == tv.tensor_type:
            w = QuantWeight.from_gguf(f"blk.{layer}.kv{h}", tk.tensor_type,
                                      np.concatenate([rk[rows], rv[rows]]), (2 * hd, cfg.dim),
                                      arithmetic=matmul)
        else:
            w = [QuantWeight.from_gguf(f"blk.{layer}.k{h}", tk.tensor_type, rk[rows].copy(),
                                       (hd, cfg.dim), arithmetic=matmul),
                 QuantWeight.from_gguf(f"blk.{layer}.v{h}", tv.tensor_type, rv[rows].copy(),
                                       (hd, cfg.dim), arithmetic=matmul)]
        b = None if bias is None else np.concatenate([bias[0][rows], bias[1][rows]])
        out.append((w, b))
    return out


class RecomputeKv:
    """Keeps layer inputs; rebuilds any page's K/V rows from them (see module docstring).

    capacity_tokens: allocate every layer's input rows for that many tokens up front (a
    budgeted sequence: the bytes are known, counted and never reallocated; writing past them is
    a CapacityError). None: grow as needed (an unbounded sequence)."""

    def __init__(self, net, capacity_tokens: int | None = None):
        self.net, self.capacity = net, capacity_tokens
        c = net.config
        self.inputs: dict[int, np.ndarray] = {}   # layer -> (capacity, dim) float32
        self.n_tokens: dict[int, int] = {}
        if capacity_tokens is not None:
            for layer in range(c.n_layers):
                self.inputs[layer] = np.empty((capacity_tokens, c.dim), dtype=np.float32)
                self.n_tokens[layer] = 0

    @property
    def nbytes(self) -> int:
        return sum(self.n_tokens[k] * a.shape[1] * 4 for k, a in self.inputs.items())

    @property
    def allocated_bytes(self) -> int:
        return sum(a.nbytes for a in self.inputs.values())

    keeps_mapped_blocks = True  # no layer inputs for mapped tokens: the session keeps the blocks
    bytes_read = 0  # reads no file

    def table_bytes(self) -> int:
        """No page tables: the kept inputs are counted by `allocations`."""
        return 0

    def close(self) -> None:
        self.inputs.clear()
        self.n_tokens.clear()

    def record(self, layer: int, pos0: int, x: np.ndarray, k, v) -> None:
        """Fresh rows of tokens pos0..: keep their layer input x (T, dim); K/V are rebuilt."""
        self.write(layer, pos0, x)

    def record_block(self, layer: int, pos0: int, k_st, v_st) -> None:
        """Mapped prefix rows: nothing to keep (the session holds the blocks themselves)."""

    def allocations(self) -> dict[str, int]:
        return {"recompute_inputs": self.allocated_bytes}

    def write(self, layer: int, pos0: int, x: np.ndarray) -> None:
        buf = self.inputs.get(layer)
        need = pos0 + x.shape[0]
        if self.capacity is not None and need > self.capacity:
            raise CapacityError(f"recompute keeps layer inputs for {self.capacity} tokens "
                                f"(the context limit); token {need - 1} is past them")
        if buf is None or buf.shape[0] < need:
            new = np.empty((max(need, 2 * (0 if buf is None else buf.shape[0]), 64), x.shape[1]),
                           dtype=np.float32)
            if buf is not None:
                new[:self.n_tokens[layer]] = buf[:self.n_tokens[layer]]
            buf = self.inputs[layer] = new
        buf[pos0:need] = x
        self.n_tokens[layer] = need

    def regenerate_page(self, key: PageKey, tokens: range, k_out: np.ndarray,
                        v_out: np.ndarray) -> None:
        have = self.n_tokens.get(key.layer, 0)
        if tokens.stop > have:
            raise CorruptPageError(f"{key}: only {have} layer inputs kept, "
                                   f"tokens up to {tokens.stop} requested")
        x = self.inputs[key.layer][tokens.start:tokens.stop]
        positions = np.arange(tokens.start, tokens.stop, dtype=np.int64)
        k_out[...], v_out[...] = self.net.head_kv(key.layer, key.kv_head, x, positions)
