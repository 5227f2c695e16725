"""Tiny `deepseek2` (MLA) GGUF files with the tensor names, shapes and metadata llama.cpp reads.

Per layer: attn_norm; the query either direct, attn_q (H (N + R), dim), or low rank, attn_q_a
(q_lora, dim) + attn_q_a_norm (q_lora,) + attn_q_b (H (N + R), q_lora); attn_kv_a_mqa
(r + R, dim); attn_kv_a_norm (r,); the up-projections as attn_k_b (ne [N, r, H]) and attn_v_b
(ne [r, Dv, H]), or (fused=True) the older attn_kv_b (H (N + Dv), r); attn_output (dim, H Dv);
ffn_norm; then a dense SwiGLU (ffn_gate/up/down) for the first `n_dense_lead` layers, MoE for the
rest: ffn_gate_inp (E, dim) F32, ffn_{gate,up,down}_exps, the shared expert ffn_*_shexp, and
with sigmoid gating exp_probs_b.bias (E,) F32. Metadata as llama.cpp's converter writes it
(key/value_length = r + R / r and key/value_length_mla = N + R / Dv for the split form; the
fused form writes key/value_length = N + R / Dv only). `yarn=(factor, original context,
log_mul)` adds YaRN rope scaling. The tokenizer is the bundled SmolLM2 model's.
Nothing here is used by the engine.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter, RopeScalingType
from gguf.quants import quantize

from cfr_atlas.testing.tiny_gguf import finish
from cfr_atlas.testing.tiny_moe import _tokenizer, _tokenizer_fields, bundled_tokenizer_path

DEFAULTS = dict(n_layers=3, dim=64, n_heads=4, q_lora=32, kv_lora=32, nope=32, rope=16,
                v_head=32, ff=64, expert_ff=32, n_experts=4, n_used=2, n_shared=1,
                n_dense_lead=1)


def _attention(rng, mat, norm, p, g, low_rank, fused):
    H, dim, r, N, R, Dv = g["n_heads"], g["dim"], g["kv_lora"], g["nope"], g["rope"], g["v_head"]
    out = [(p + "attn_norm.weight", False, norm(dim))]
    if low_rank:
        out += [(p + "attn_q_a.weight", True, mat(g["q_lora"], dim)),
                (p + "attn_q_a_norm.weight", False, norm(g["q_lora"])),
                (p + "attn_q_b.weight", True, mat(H * (N + R), g["q_lora"]))]
    else:
        out.append((p + "attn_q.weight", True, mat(H * (N + R), dim)))
    out += [(p + "attn_kv_a_mqa.weight", True, mat(r + R, dim)),
            (p + "attn_kv_a_norm.weight", False, norm(r))]
    k_b = np.stack([mat(r, N) for _ in range(H)]) * math.sqrt(N / r)  # (H, r, N): W_kb[h]
    v_b = np.stack([mat(Dv, r) for _ in range(H)])  # (H, Dv, r)
    if fused:  # per head: the N rows of k_nope = W_kb[h]^T, then the Dv rows of v
        kv_b = np.concatenate([np.concatenate([k_b[h].T, v_b[h]]) for h in range(H)])
        out.append((p + "attn_kv_b.weight", True, kv_b))
    else:
        out += [(p + "attn_k_b.weight", True, k_b), (p + "attn_v_b.weight", True, v_b)]
    return out + [(p + "attn_output.weight", True, mat(dim, H * Dv))]


def _ffn(rng, mat, p, g, moe, sigmoid):
    dim = g["dim"]
    if not moe:
        return [(p + "ffn_gate.weight", True, mat(g["ff"], dim)),
                (p + "ffn_up.weight", True, mat(g["ff"], dim)),
                (p + "ffn_down.weight", True, mat(dim, g["ff"]))]
    E, eff, sff = g["n_experts"], g["expert_ff"], g["expert_ff"] * g["n_shared"]
    out = [(p + "ffn_gate_inp.weight", False, mat(E, dim) * 4.0)]
    if sigmoid:
        out.append((p + "exp_probs_b.bias", False, 0.1 * rng.standard_normal(E)))
    out += [(p + "ffn_gate_exps.weight", True, np.stack([mat(eff, dim) for _ in range(E)])),
            (p + "ffn_up_exps.weight", True, np.stack([mat(eff, dim) for _ in range(E)])),
            (p + "ffn_down_exps.weight", True, np.stack([mat(dim, eff) for _ in range(E)])),
            (p + "ffn_gate_shexp.weight", True, mat(sff, dim)),
            (p + "ffn_up_shexp.weight", True, mat(sff, dim)),
            (p + "ffn_down_shexp.weight", True, mat(dim, sff))]
    return out


def _metadata(w: GGUFWriter, g: dict, *, low_rank, fused, moe, sigmoid, yarn, context_length):
    w.add_name("tiny-deepseek2")
    w.add_block_count(g["n_layers"])
    w.add_context_length(context_length)
    w.add_embedding_length(g["dim"])
    w.add_feed_forward_length(g["ff"])
    w.add_head_count(g["n_heads"])
    w.add_head_count_kv(1 if not fused else g["n_heads"])
    if fused:
        w.add_key_length(g["nope"] + g["rope"])
        w.add_value_length(g["v_head"])
    else:
        w.add_key_length(g["kv_lora"] + g["rope"])
        w.add_value_length(g["kv_lora"])
        w.add_key_length_mla(g["nope"] + g["rope"])
        w.add_value_length_mla(g["v_head"])
    w.add_rope_dimension_count(g["rope"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_q_lora_rank(g["q_lora"] if low_rank else 0)
    w.add_kv_lora_rank(g["kv_lora"])
    w.add_leading_dense_block_count(g["n_dense_lead"] if moe else g["n_layers"])
    w.add_expert_feed_forward_length(g["expert_ff"])
    w.add_expert_count(g["n_experts"] if moe else 0)
    w.add_expert_used_count(g["n_used"] if moe else 0)
    w.add_expert_shared_count(g["n_shared"] if moe else 0)
    w.add_expert_weights_scale(2.5 if moe else 1.0)
    w.add_expert_weights_norm(sigmoid)
    w.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if sigmoid
                             else ExpertGatingFuncType.SOFTMAX)
    w.add_rope_scaling_yarn_log_mul(0.1 if yarn is None else yarn[2])
    if yarn is not None:
        w.add_rope_scaling_type(RopeScalingType.YARN)
        w.add_rope_scaling_factor(yarn[0])
        w.add_rope_scaling_orig_ctx_len(yarn[1])


def write_tiny_deepseek2(path, *, qtype: str = "Q8_0", low_rank: bool = True,
                         fused: bool = False, moe: bool = True, sigmoid: bool = False,
                         yarn: tuple | None = None, context_length: int = 4096, seed: int = 0,
                         tokenizer_from=None, **sizes) -> Path:
    """Write a tiny deepseek2 GGUF to `path` (temp file, then os.replace); matrices in `qtype`,
    norms, routers and biases F32. `sizes` override DEFAULTS (dim, n_heads, kv_lora, ...)."""
    g = {**DEFAULTS, **sizes}
    src = Path(tokenizer_from) if tokenizer_from else bundled_tokenizer_path()
    vocab = len({k: v for k, v, *_ in _tokenizer_fields(str(src))}["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)

    def mat(n_out, n_in):
        return rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    tensors = [("token_embd.weight", True, 2.0 * mat(vocab, g["dim"]))]
    for i in range(g["n_layers"]):
        p = f"blk.{i}."
        tensors += _attention(rng, mat, norm, p, g, low_rank, fused)
        tensors.append((p + "ffn_norm.weight", False, norm(g["dim"])))
        tensors += _ffn(rng, mat, p, g, moe and i >= g["n_dense_lead"], sigmoid)
    tensors += [("output_norm.weight", False, norm(g["dim"])),
                ("output.weight", True, 2.0 * mat(vocab, g["dim"]))]
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = GGUFWriter(tmp, "deepseek2")
    _metadata(w, g, low_rank=low_rank, fused=fused, moe=moe, sigmoid=sigmoid, yarn=yarn,
              context_length=context_length)
    w.add_vocab_size(vocab)
    _tokenizer(w, src)
    for name, is_matrix, array in tensors:
        t = GGMLQuantizationType[qtype if is_matrix else "F32"]
        w.add_tensor(name, quantize(array.astype(np.float32), t), raw_dtype=t)
    return finish(w, tmp, path)
