"""Tiny `gemma3` GGUF files for tests: the tensor set and metadata llama.cpp's converter writes
for Gemma 3 (QK-norm, post-attention and post-FFN norms, sliding window), random weights.

The vocabulary is tiny_gguf's byte-level BPE one (the model does not care which tokenizer made
its ids). Norm weights are stored as llama.cpp's converter stores them, already (1 + w).
Nothing here is used by the engine at run time.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import quantize

from cfr_atlas.testing.tiny_gguf import CHATML_TEMPLATE, EOS_TOKEN, build_vocab, finish


def _tensors(rng, *, n_layers, dim, n_heads, n_kv_heads, head_dim, hidden_dim, vocab):
    """[(name, is_matrix, float32 array)] in file order."""
    def mat(n_out, n_in):
        return rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(n):
        return 1.0 + 0.2 * rng.standard_normal(n)

    out = [("token_embd.weight", True, 2.0 * mat(vocab, dim))]  # tied: logits of std ~2
    for i in range(n_layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", False, norm(dim)),
                (p + "attn_q.weight", True, mat(n_heads * head_dim, dim)),
                (p + "attn_k.weight", True, mat(n_kv_heads * head_dim, dim)),
                (p + "attn_v.weight", True, mat(n_kv_heads * head_dim, dim)),
                (p + "attn_q_norm.weight", False, norm(head_dim)),
                (p + "attn_k_norm.weight", False, norm(head_dim)),
                (p + "attn_output.weight", True, mat(dim, n_heads * head_dim)),
                (p + "post_attention_norm.weight", False, 0.5 * norm(dim)),
                (p + "ffn_norm.weight", False, norm(dim)),
                (p + "ffn_gate.weight", True, mat(hidden_dim, dim)),
                (p + "ffn_up.weight", True, mat(hidden_dim, dim)),
                (p + "ffn_down.weight", True, mat(dim, hidden_dim)),
                (p + "post_ffw_norm.weight", False, 0.5 * norm(dim))]
    out.append(("output_norm.weight", False, norm(dim)))
    return [(n, m, a.astype(np.float32)) for n, m, a in out]


def write_tiny_gemma3(path, *, qtype: str = "Q8_0", n_layers: int = 7, dim: int = 64,
                      n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 32,
                      hidden_dim: int = 128, sliding_window: int = 24,
                      rope_theta: float = 1_000_000.0, context_length: int = 4096,
                      final_softcap: float | None = None, seed: int = 0) -> Path:
    """Write a tiny gemma3 GGUF to `path` (temp file, then os.replace) and return the path."""
    tokens, merges, token_types = build_vocab()
    rng = np.random.default_rng(seed)
    tensors = _tensors(rng, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
                       head_dim=head_dim, hidden_dim=hidden_dim, vocab=len(tokens))
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = GGUFWriter(tmp, "gemma3")
    w.add_name("tiny-gemma3")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(hidden_dim)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(sliding_window)
    if final_softcap is not None:
        w.add_final_logit_softcapping(final_softcap)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types(token_types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index(EOS_TOKEN))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML_TEMPLATE)
    for name, is_matrix, array in tensors:
        t = GGMLQuantizationType[qtype if is_matrix else "F32"]
        w.add_tensor(name, quantize(array, t), raw_dtype=t)
    return finish(w, tmp, path)
