"""Float64 reference forward pass for gemma3 GGUF files, written plainly from llama.cpp's
gemma3 graph (see cfr_atlas.models.gemma3's docstring for the equations).

Shares no code with `cfr_atlas`: gguf-py reads and dequantizes every tensor to float64, and the
whole model runs top to bottom with no cache and an explicit (T, T) mask per layer:
key p is visible to query t when p <= t and, on sliding-window layers (l % 6 < 5), t - p <
window. RoPE is NEOX (pairs (x[i], x[i + hd/2])), base 10,000 on local layers and the file's
`rope.freq_base` on global ones. Norm weights are used as stored (the converter wrote 1 + w).
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def _meta(r: GGUFReader, key: str, default=None):
    f = r.get_field(key)
    if f is None:
        if default is None:
            raise KeyError(key)
        return default
    return f.contents()


def _weights(r: GGUFReader) -> dict[str, np.ndarray]:
    out = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        shape = [int(n) for n in reversed(t.shape)]
        out[t.name] = a.reshape(shape) if len(shape) > 1 else a.reshape(-1)
    return out


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta):
    """x (T, H, hd) NEOX-rotated at positions pos (T,) with base theta."""
    hd = x.shape[-1]
    half = hd // 2
    freq = theta ** (-np.arange(half, dtype=np.float64) * 2 / hd)
    ang = pos[:, None] * freq[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., :half], x[..., half:]
    return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def _gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gemma3_reference_logits(path, ids) -> np.ndarray:
    """All positions' logits (T, vocab) float64 for token ids `ids` from position 0."""
    r = GGUFReader(str(path))
    W = _weights(r)
    a = "gemma3"
    n_layers, dim = _meta(r, f"{a}.block_count"), _meta(r, f"{a}.embedding_length")
    H, KV = _meta(r, f"{a}.attention.head_count"), _meta(r, f"{a}.attention.head_count_kv")
    hd = _meta(r, f"{a}.attention.key_length")
    eps = _meta(r, f"{a}.attention.layer_norm_rms_epsilon")
    theta, window = _meta(r, f"{a}.rope.freq_base"), _meta(r, f"{a}.attention.sliding_window")
    cap = _meta(r, f"{a}.final_logit_softcapping", 0.0)
    ids = np.asarray(ids)
    T = len(ids)
    pos = np.arange(T, dtype=np.float64)
    t_idx, p_idx = np.arange(T)[:, None], np.arange(T)[None, :]
    x = W["token_embd.weight"][ids] * math.sqrt(dim)
    for i in range(n_layers):
        p = f"blk.{i}."
        local = i % 6 < 5
        h = _rms(x, W[p + "attn_norm.weight"], eps)
        q = (h @ W[p + "attn_q.weight"].T).reshape(T, H, hd)
        k = (h @ W[p + "attn_k.weight"].T).reshape(T, KV, hd)
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, KV, hd)
        q = _rope(_rms(q, W[p + "attn_q_norm.weight"], eps), pos, 10000.0 if local else theta)
        k = _rope(_rms(k, W[p + "attn_k_norm.weight"], eps), pos, 10000.0 if local else theta)
        visible = (p_idx <= t_idx) & ((t_idx - p_idx < window) if local else True)
        out = np.zeros((T, H, hd))
        for head in range(H):
            kv = head // (H // KV)
            s = q[:, head] @ k[:, kv].T / math.sqrt(hd)
            s = np.where(visible, s, -np.inf)
            e = np.exp(s - s.max(axis=1, keepdims=True))
            out[:, head] = (e / e.sum(axis=1, keepdims=True)) @ v[:, kv]
        attn = out.reshape(T, H * hd) @ W[p + "attn_output.weight"].T
        x = x + _rms(attn, W[p + "post_attention_norm.weight"], eps)
        h = _rms(x, W[p + "ffn_norm.weight"], eps)
        ffn = (_gelu(h @ W[p + "ffn_gate.weight"].T) * (h @ W[p + "ffn_up.weight"].T)) \
            @ W[p + "ffn_down.weight"].T
        x = x + _rms(ffn, W[p + "post_ffw_norm.weight"], eps)
    out_w = W.get("output.weight", W["token_embd.weight"])
    logits = _rms(x, W["output_norm.weight"], eps) @ out_w.T
    return cap * np.tanh(logits / cap) if cap else logits
