"""Float64 reference forward pass for the MoE GGUF architectures (qwen2moe, qwen3moe, olmoe and
Mixtral-style llama), written plainly. It imports nothing from `cfr_atlas`: NumPy and gguf-py
(reader + dequantize) only, and reuses the dense helpers of tests/models/reference.py.

Per layer, as llama.cpp's graphs define it (llama-graph.cpp build_moe_ffn and src/models/*):
    h = rms_norm(x) -> q, k, v (+ bias: qwen2moe)
    qwen3moe: q, k = rms_norm per head (attn_q_norm/attn_k_norm of head_dim)
    olmoe:    q, k = rms_norm over the whole projection (norms of n_heads*hd, n_kv*hd)
    q, k = rope (NORM for llama, NEOX otherwise);  x = x + wo attention(q, k, v)
    h2 = rms_norm(x)
    p = softmax(router h2)                        (n_experts,) per token
    top = the k largest p, ties to the lowest expert id
    w = p[top];  w = w / sum(w)   for llama (Mixtral) and qwen3moe (norm_w); not qwen2moe/olmoe
    moe = sum over ranks r in order of w_r * down_e(silu(gate_e h2) * up_e h2)
    qwen2moe: moe += sigmoid(gate_inp_shexp . h2) * shared_ffn(h2)
    x = x + moe
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGUFReader
from reference import ReferenceError, _dequantize, _meta, rms_norm, rope, silu, softmax

NEOX_ROPE = {"llama": False, "qwen2moe": True, "qwen3moe": True, "olmoe": True}
NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True, "olmoe": False}


def route(p: np.ndarray, k: int, norm: bool) -> tuple[np.ndarray, np.ndarray]:
    """p (E,) probabilities -> (expert ids (k,), weights (k,)): largest first, ties to the lowest
    id (a stable sort of -p), weights renormalized to sum 1 when `norm`."""
    top = np.argsort(-p, kind="stable")[:k]
    w = p[top]
    return top, (w / w.sum() if norm else w)


def _ffn(h: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> np.ndarray:
    return (silu(h @ gate.T) * (h @ up.T)) @ down.T


def moe_reference_logits(path, ids: list[int]) -> np.ndarray:
    """Token ids (T,) -> logits (T, vocab) float64, positions 0..T-1, full causal attention."""
    r = path if isinstance(path, GGUFReader) else GGUFReader(path)
    arch = _meta(r, "general.architecture")
    if arch not in NEOX_ROPE:
        raise ReferenceError(f"MoE reference has no {arch!r}")
    m = {k: _meta(r, f"{arch}.{k}") for k in (
        "block_count", "embedding_length", "attention.head_count", "attention.head_count_kv",
        "attention.layer_norm_rms_epsilon", "rope.freq_base", "expert_used_count")}
    n_heads, n_kv = m["attention.head_count"], m["attention.head_count_kv"]
    dim, eps, theta = m["embedding_length"], m["attention.layer_norm_rms_epsilon"], \
        m["rope.freq_base"]
    hd = _meta(r, f"{arch}.attention.key_length", dim // n_heads)
    n_rot = _meta(r, f"{arch}.rope.dimension_count", hd)
    tensors = {t.name: t for t in r.tensors}

    def W(name: str) -> np.ndarray:
        if name not in tensors:
            raise ReferenceError(f"tensor {name!r} is missing from the GGUF")
        return _dequantize(tensors[name])

    T, pos = len(ids), np.arange(len(ids))
    causal = np.triu(np.full((T, T), -np.inf), k=1)
    x = W("token_embd.weight")[np.asarray(ids)]
    for layer in range(m["block_count"]):
        p = f"blk.{layer}."
        xn = rms_norm(x, W(p + "attn_norm.weight"), eps)
        q, k, v = (xn @ W(p + f"attn_{n}.weight").T for n in "qkv")
        if p + "attn_q.bias" in tensors:
            q, k, v = q + W(p + "attn_q.bias"), k + W(p + "attn_k.bias"), v + W(p + "attn_v.bias")
        if arch == "olmoe":
            q = rms_norm(q, W(p + "attn_q_norm.weight"), eps)
            k = rms_norm(k, W(p + "attn_k_norm.weight"), eps)
        q, k, v = q.reshape(T, n_heads, hd), k.reshape(T, n_kv, hd), v.reshape(T, n_kv, hd)
        if arch == "qwen3moe":
            q = rms_norm(q, W(p + "attn_q_norm.weight"), eps)
            k = rms_norm(k, W(p + "attn_k_norm.weight"), eps)
        q = rope(q, pos, theta, n_rot, NEOX_ROPE[arch])
        k = rope(k, pos, theta, n_rot, NEOX_ROPE[arch])
        att = np.empty((T, n_heads, hd))
        for h in range(n_heads):
            kv = h // (n_heads // n_kv)
            att[:, h] = softmax(q[:, h] @ k[:, kv].T / math.sqrt(hd) + causal) @ v[:, kv]
        x = x + att.reshape(T, n_heads * hd) @ W(p + "attn_output.weight").T
        x = x + _moe(W, tensors, p, rms_norm(x, W(p + "ffn_norm.weight"), eps),
                     m["expert_used_count"], NORM_TOPK[arch])
    x = rms_norm(x, W("output_norm.weight"), eps)
    out = W("output.weight" if "output.weight" in tensors else "token_embd.weight")
    return x @ out.T


def _moe(W, tensors, p: str, h: np.ndarray, k: int, norm: bool) -> np.ndarray:
    """h (T, dim) -> the MoE block's output (T, dim), one token at a time."""
    probs = softmax(h @ W(p + "ffn_gate_inp.weight").T)  # (T, E)
    gate, up, down = (W(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        top, w = route(probs[t], k, norm)
        for e, we in zip(top, w, strict=True):
            out[t] += we * _ffn(h[t:t + 1], gate[e], up[e], down[e])[0]
    if p + "ffn_gate_inp_shexp.weight" in tensors:
        g = 1.0 / (1.0 + np.exp(-(h @ W(p + "ffn_gate_inp_shexp.weight"))))  # (T,)
        out += g[:, None] * _ffn(h, W(p + "ffn_gate_shexp.weight"), W(p + "ffn_up_shexp.weight"),
                                 W(p + "ffn_down_shexp.weight"))
    return out
