"""The feed-forward blocks the Llama-family models share: dense SwiGLU and mixture of experts.

MoE, as llama.cpp's build_moe_ffn computes it for qwen2moe, qwen3moe, olmoe and Mixtral:

    p   = softmax(router h)                       (T, n_experts) float32
    top = the k largest p per token, ties to the lowest expert id (a stable sort of -p)
    w   = p[top], then w / max(sum(w), 2^-14) where the architecture renormalizes (NORM_TOPK)
    y   = sum over ranks r = 0..k-1, in that order, of w_r * down_e(silu(gate_e h) * up_e h)
    qwen2moe adds its shared expert: y += sigmoid(gate_inp_shexp . h) * shared_ffn(h)
    deepseek2: w scaled by expert_weights_scale; V3 gates by sigmoid with a selection bias;
    its shared experts are added ungated: y += shared_ffn(h)

Each expert runs once over the rows routed to it; every kernel is row-independent (a row's
bits do not depend on which rows share its call), so the result per token is the same for any
chunking, batching, expert budget or turn order. Expert weights come from an `ExpertStore`.
Not here: attention, the store's slots and policies (experts/), reading metadata (llama.py).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from cfr_atlas.errors import ModelFormatError
from cfr_atlas.experts import ExpertMatrix, ExpertSource
from cfr_atlas.ops import gated_halves
from cfr_atlas.quant import QuantWeight

# architecture -> whether the top-k weights are renormalized to sum 1 (llama.cpp's norm_w)
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}
WEIGHTS_SUM_MIN = np.float32(6.103515625e-5)  # llama.cpp clamps the sum before dividing
EXPERT_ROLES = ("gate", "up", "down")


class DenseFfn:
    """x (T, dim) -> down(silu(gate x) * up x), gate|up fused when they share a format."""

    def __init__(self, w_gate_up, w_down: QuantWeight, hidden_dim: int, matmul_fn):
        self.w_gate_up, self.w_down, self.hidden_dim = w_gate_up, w_down, hidden_dim
        self._matmul = matmul_fn

    def __call__(self, h: np.ndarray) -> np.ndarray:
        gu = self._matmul(self.w_gate_up, h)
        return self.w_down.matmul(gated_halves(gu))  # gu: [gate | up], hidden_dim each

    def weights(self) -> list:
        gu = self.w_gate_up
        return [*(gu if isinstance(gu, list) else [gu]), self.w_down]


@njit(cache=True, nogil=True)
def _row_sums(e: np.ndarray) -> np.ndarray:
    """e (T, E) float32 -> (T,) float32: per row e[0] + e[1] + ... in column order, one float32
    rounding per add (no fastmath), as the NumPy loop `s += e[:, j]` adds them."""
    out = np.empty(e.shape[0], dtype=np.float32)
    for t in range(e.shape[0]):
        s = e[t, 0]
        for j in range(1, e.shape[1]):
            s += e[t, j]
        out[t] = s
    return out


def softmax_rows(x: np.ndarray) -> np.ndarray:
    """x (T, E) float32 -> softmax per row, float32; sums each row in expert order, so a row's
    bits never depend on the other rows (NumPy's exp, a compiled sum: one call instead of a
    Python loop of E vector adds)."""
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / _row_sums(np.ascontiguousarray(e))[:, None]


def route(logits: np.ndarray, k: int, norm: bool, scale: float | None = None, *,
          sigmoid: bool = False, bias: np.ndarray | None = None):
    """Router logits (T, E) float32 -> (top (T, k) int64 expert ids, w (T, k) float32).

    sigmoid: p = sigmoid(logits) instead of softmax (DeepSeek V3's gating); bias (E,) f32: added
    to p for choosing the top k only (exp_probs_b), the weights stay p's."""
    p = (np.float32(1) / (np.float32(1) + np.exp(-logits))) if sigmoid else softmax_rows(logits)
    top = np.argsort(-(p if bias is None else p + bias), axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, axis=1)
    if norm:
        w = w / np.maximum(_row_sums(np.ascontiguousarray(w)), WEIGHTS_SUM_MIN)[:, None]
    if scale is not None:
        w = w * np.float32(scale)
    return top, w


class MoeFfn:
    """One layer's MoE block; see the module docstring. `store` serves the routed experts."""

    def __init__(self, layer: int, router: QuantWeight, k: int, norm: bool, store,
                 shared: DenseFfn | None = None, shared_gate: QuantWeight | None = None, *,
                 routing: dict | None = None):
        self.layer, self.router, self.k, self.norm = layer, router, k, norm
        self.store, self.shared, self.shared_gate = store, shared, shared_gate
        self.routing = routing or {}  # route()'s scale / sigmoid / bias (deepseek2)
        self.next_router: QuantWeight | None = None  # the next layer's, for read-ahead

    def __call__(self, h: np.ndarray) -> np.ndarray:
        T, dim = h.shape
        top, w = route(self.router.matmul(h), self.k, self.norm, **self.routing)
        self.store.record_routing(self.layer, top)
        predicting = self.next_router is not None and self.store.wants_ahead(self.layer + 1)
        ahead = self._predict(h) if predicting else None
        ys = np.zeros((T, self.k, dim), dtype=np.float32)  # (token, rank) -> expert output
        for e, gate_up, down in self.store.experts(self.layer, np.unique(top), ahead):
            rows, ranks = np.nonzero(top == e)
            gu = gate_up.matmul(np.ascontiguousarray(h[rows]))
            ys[rows, ranks] = down.matmul(gated_halves(gu))
        out = ys[:, 0] * w[:, :1]
        for r in range(1, self.k):  # expert outputs summed in rank order
            out += ys[:, r] * w[:, r:r + 1]
        if self.shared is not None and self.shared_gate is None:  # deepseek2: plain sum
            out += self.shared(h)
        elif self.shared is not None:
            g = self.shared_gate.matmul(h)  # (T, 1)
            out += self.shared(h) * (np.float32(1) / (np.float32(1) + np.exp(-g)))
        return out

    def _predict(self, h: np.ndarray) -> np.ndarray:
        """The next layer's experts, predicted by its router on this layer's input (the residual
        stream changes little between layers), for the store's read-ahead and prefetcher;
        affects speed only (nothing computed here reaches the output). Softmax and sigmoid keep
        the logits' order, so the k largest logits are the choice without them (a partition,
        not route's stable sort: ~10x cheaper); a selection bias needs route's sum."""
        logits = self.next_router.matmul(h)
        if self.routing.get("bias") is not None:
            predicted, _ = route(logits, self.k, self.norm, **self.routing)
        else:
            predicted = np.argpartition(logits, -self.k, axis=1)[:, -self.k:]
        return np.unique(predicted)


def link_layers(ffns: list) -> None:
    """Give each MoE block the next layer's router (to predict its experts)."""
    for ffn, nxt in zip(ffns, ffns[1:], strict=False):
        if isinstance(ffn, MoeFfn) and isinstance(nxt, MoeFfn):
            ffn.next_router = nxt.router


def expert_matrices(gf, layer: int, dim: int) -> tuple[ExpertMatrix, ...]:
    """The layer's ffn_{gate,up,down}_exps as ExpertMatrix (data viewed per expert)."""
    out = []
    for role in EXPERT_ROLES:
        t = gf.tensor(f"blk.{layer}.ffn_{role}_exps.weight")
        if len(t.shape) != 3:
            raise ModelFormatError(f"{t.name} has shape {list(t.shape)}; expected 3 dims "
                                   "[cols, rows, n_experts]")
        cols, rows, n = (int(s) for s in t.shape)
        if (cols if role != "down" else rows) != dim:
            raise ModelFormatError(f"{t.name}: shape {[cols, rows, n]} does not fit dim {dim}")
        out.append(ExpertMatrix(t.name, t.tensor_type, np.asarray(t.data).reshape(n, rows, -1),
                                rows, cols, int(t.data_offset)))
    return tuple(out)


def expert_source(gf, cfg, matmul: str) -> ExpertSource:
    src = ExpertSource([expert_matrices(gf, i, cfg.dim) for i in range(cfg.n_layers)], matmul,
                       gf.path, gf.version())
    if src.n_experts != cfg.n_experts:
        raise ModelFormatError(f"{gf.path.name}: expert tensors hold {src.n_experts} experts, "
                               f"metadata {cfg.arch}.expert_count says {cfg.n_experts}")
    return src
