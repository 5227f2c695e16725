"""Float64 reference forward pass for `deepseek2` (MLA) in the NON-absorbed form, written plainly.
It imports nothing from `cfr_atlas`: NumPy and gguf-py (reader + dequantize) and the dense helpers
of tests/models/reference.py.

Per layer (H heads, latent r, rope R, nope N, value Dv), decompressed to plain multi-head
attention, as HF's DeepseekV2Attention writes it:
    h = rms_norm(x);  q = wq h  or  wq_b rms_norm(wq_a h)           (T, H, N + R)
    [c; k_pe] = wkv_a_mqa h;  c = rms_norm(c);  q_pe, k_pe = rope (adjacent pairs, YaRN)
    k_nope[h] = c @ W_kb[h]   (N,)      v[h] = c @ W_vb[h]^T   (Dv,)   (per-head up-projections)
    k[h] = [k_nope[h]; k_pe],  q[h] = [q_nope[h]; q_pe[h]]
    o[h] = softmax(scale q[h] . k[h]) v[h];  x = x + wo o;   scale = mscale^2 / sqrt(N + R)
    ffn: dense SwiGLU for leading blocks; MoE: p = softmax or sigmoid(router h2), top-k chosen
    by p (+ exp_probs_b), w = p[top] (/ sum if norm) * scale, + shared SwiGLU
YaRN (HF's yarn_find_correction_range and linear ramp): inv_freq = interp * (1 - mask) +
extrap * mask, mask = 1 - ramp(low, high) over the pairs; cos/sin times attn_factor.
"""

from __future__ import annotations

import math

import numpy as np
from gguf import GGUFReader
from reference import _dequantize, _meta, rms_norm, silu, softmax

A = "deepseek2"


def _rope_table(pos, r, R):
    theta = _meta(r, f"{A}.rope.freq_base", 10000.0)
    extrap = 1.0 / theta ** (np.arange(0, R, 2, dtype=np.float64) / R)
    inv_freq = extrap
    if _meta(r, f"{A}.rope.scaling.type", "none") == "yarn":
        factor = _meta(r, f"{A}.rope.scaling.factor")
        orig = _meta(r, f"{A}.rope.scaling.original_context_length")

        def dim(rot):  # HF yarn_find_correction_dim
            return (R * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

        low, high = max(math.floor(dim(32)), 0), min(math.ceil(dim(1)), R - 1)
        ramp = np.clip((np.arange(R // 2) - low) / max(high - low, 0.001), 0, 1)
        mask = 1.0 - ramp
        inv_freq = extrap / factor * (1 - mask) + extrap * mask
    a = _meta(r, f"{A}.rope.scaling.attn_factor", 1.0)
    ang = pos.astype(np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang) * a, np.sin(ang) * a


def _rot(x, cos, sin):
    """x (T, ..., R): adjacent pairs (x[2i], x[2i+1]) turned by the table (T, R/2)."""
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (cos.shape[1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * c - b * s, a * s + b * c
    return out


def _ffn(h, gate, up, down):
    return (silu(h @ gate.T) * (h @ up.T)) @ down.T


def deepseek2_reference_logits(path, ids: list[int]) -> np.ndarray:
    """Token ids (T,) -> logits (T, vocab) float64, positions 0..T-1, full causal attention."""
    r = path if isinstance(path, GGUFReader) else GGUFReader(path)
    tensors = {t.name: t for t in r.tensors}

    def W(name):
        return _dequantize(tensors[name])

    def m(key, default=None):
        return _meta(r, f"{A}.{key}", default) if default is not None else _meta(r, f"{A}.{key}")

    L, H, eps = m("block_count"), m("attention.head_count"), m("attention.layer_norm_rms_epsilon")
    rank, R = m("attention.kv_lora_rank"), m("rope.dimension_count")
    kdim = m("attention.key_length_mla", 0) or m("attention.key_length")
    vdim = m("attention.value_length_mla", 0) or m("attention.value_length")
    N, lead, E = kdim - R, m("leading_dense_block_count", 0), m("expert_count", 0)
    mscale = m("rope.scaling.attn_factor", 1.0)
    if m("rope.scaling.type", "none") == "yarn":  # HF: softmax_scale *= yarn_get_mscale^2
        mscale_all_dim = m("rope.scaling.yarn_log_multiplier") / 0.1  # the converter wrote 0.1x
        mscale *= 0.1 * mscale_all_dim * math.log(m("rope.scaling.factor")) + 1
    scale = mscale * mscale / math.sqrt(kdim)
    T = len(ids)
    cos, sin = _rope_table(np.arange(T), r, R)
    x = W("token_embd.weight")[ids]
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(L):
        p = f"blk.{i}."
        h = rms_norm(x, W(p + "attn_norm.weight"), eps)
        if p + "attn_q.weight" in tensors:
            q = h @ W(p + "attn_q.weight").T
        else:
            qa = rms_norm(h @ W(p + "attn_q_a.weight").T, W(p + "attn_q_a_norm.weight"), eps)
            q = qa @ W(p + "attn_q_b.weight").T
        q = q.reshape(T, H, kdim)
        kv = h @ W(p + "attn_kv_a_mqa.weight").T
        c = rms_norm(kv[:, :rank], W(p + "attn_kv_a_norm.weight"), eps)
        k_pe = _rot(kv[:, rank:], cos, sin)  # (T, R), shared by every head
        q_pe = _rot(q[:, :, N:], cos, sin)
        if p + "attn_k_b.weight" in tensors:
            k_b = W(p + "attn_k_b.weight")  # (H, rank, N)
            v_b = W(p + "attn_v_b.weight")  # (H, Dv, rank)
            k_nope = np.einsum("tc,hcn->thn", c, k_b)
            v = np.einsum("tc,hvc->thv", c, v_b)
        else:
            kv_b = W(p + "attn_kv_b.weight").reshape(H, N + vdim, rank)
            both = np.einsum("tc,hjc->thj", c, kv_b)
            k_nope, v = both[:, :, :N], both[:, :, N:]
        o = np.empty((T, H, vdim))
        for hd in range(H):
            k = np.concatenate([k_nope[:, hd], k_pe], axis=1)  # (T, N + R)
            qh = np.concatenate([q[:, hd, :N], q_pe[:, hd]], axis=1)
            o[:, hd] = softmax(scale * qh @ k.T + mask) @ v[:, hd]
        x = x + o.reshape(T, -1) @ W(p + "attn_output.weight").T
        h2 = rms_norm(x, W(p + "ffn_norm.weight"), eps)
        if i < lead or not E:
            x = x + _ffn(h2, W(p + "ffn_gate.weight"), W(p + "ffn_up.weight"),
                         W(p + "ffn_down.weight"))
            continue
        x = x + _moe(h2, W, p, tensors, m)
    x = rms_norm(x, W("output_norm.weight"), eps)
    return x @ W("output.weight").T


def _moe(h, W, p, tensors, m):
    logits = h @ W(p + "ffn_gate_inp.weight").T
    sigmoid = m("expert_gating_func", 1) == 2
    probs = 1 / (1 + np.exp(-logits)) if sigmoid else softmax(logits)
    choose = probs + (W(p + "exp_probs_b.bias") if p + "exp_probs_b.bias" in tensors else 0)
    k, norm, scale = m("expert_used_count"), bool(m("expert_weights_norm", False)), \
        m("expert_weights_scale", 1.0)
    gate, up, down = (W(p + f"ffn_{x}_exps.weight") for x in ("gate", "up", "down"))
    out = _ffn(h, W(p + "ffn_gate_shexp.weight"), W(p + "ffn_up_shexp.weight"),
               W(p + "ffn_down_shexp.weight"))
    for t in range(h.shape[0]):
        top = np.argsort(-choose[t], kind="stable")[:k]
        w = probs[t, top]
        w = (w / w.sum() if norm else w) * scale
        for e, we in zip(top, w, strict=True):
            out[t] += we * _ffn(h[t:t + 1], gate[e], up[e], down[e])[0]
    return out
