"""The Gemma 3 family (`gemma3`): config from GGUF metadata, weights, the forward pass.

As llama.cpp's gemma3 graph (src/models/gemma3.cpp) defines it, per layer l:

    x = embed(ids) * sqrt(dim)                                    (once, before layer 0)
    h = rms_norm(x) -> q, k, v;  q, k = rms_norm_per_head(q), rms_norm_per_head(k)   (QK-norm)
    q, k = rope(q, k; base_l)  NEOX;  scores scaled by query_scale (head_dim^-0.5)
    a = attention(q, k, v; window_l);  x = x + post_attn_norm(wo a)
    x = x + post_ffn_norm(w_down(gelu_tanh(w_gate h2) * w_up h2)),  h2 = ffn_norm(x)
    logits = output(rms_norm(x)), soft-capped if the file says so

Local (sliding-window) layers are those with l % swa_pattern < swa_pattern - 1 (5 of every 6):
window `gemma3.attention.sliding_window`, RoPE base 10,000 unscaled; global layers (every 6th)
use the file's `rope.freq_base` and its linear `rope.scaling`. A key at position p is visible
to a query at position t when t - window < p <= t (llama.cpp's LLAMA_SWA_TYPE_STANDARD).
Norm weights are used as stored: llama.cpp's converter already wrote Gemma's (1 + w).
Local layers attend through the Atlas with `window`, so pages wholly before the window are
neither regenerated nor folded, and the session drops them from the hot cache (`forget`).
This module holds no sampling, tokenization or generation loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import ModelFormatError
from cfr_atlas.models.batch import BatchItem, batched_forward, forward_layers
from cfr_atlas.models.decode import DecodeLayer, DecodeStep, parts
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.models.llama import LIMITS, _fused, _matmul, _weight, embed_and_head, rope_freq_scale
from cfr_atlas.ops import gated_halves, rms_norm, rope_cos_sin, rope_freqs, rotate
from cfr_atlas.ops.activations import softcap
from cfr_atlas.ops.norm import rms_norm_per_head
from cfr_atlas.quant.weight import check_arithmetic

SWA_PATTERN = 6  # llama.cpp: hparams.set_swa_pattern(6) for gemma3
LOCAL_ROPE_BASE = 10_000.0  # llama.cpp: rope_freq_base_train_swa for gemma3


@dataclass(frozen=True)
class Gemma3Config:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float  # global layers' base (the file's)
    rope_freq_scale: float  # global layers only
    sliding_window: int
    query_scale: float
    final_softcap: float  # 0 = none
    rope_mode: str = "neox"
    swa_pattern: int = SWA_PATTERN

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def value_dim(self) -> None:
        """V rows are stored beside K (not a view of K, as MLA's latent is)."""
        return None

    def is_local(self, layer: int) -> bool:
        """True for sliding-window layers (5 of every `swa_pattern`)."""
        return layer % self.swa_pattern < self.swa_pattern - 1

    def window(self, layer: int) -> int | None:
        """Keys a query of `layer` can see (None: the whole causal context)."""
        return self.sliding_window if self.is_local(layer) else None

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """K + V bytes one token adds across all layers while every layer still holds it."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

    def kv_bytes(self, n_tokens: int, itemsize: int = 2) -> int:
        """K + V bytes a context of `n_tokens` needs: local layers hold only their window."""
        per_layer = 2 * self.n_kv_heads * self.head_dim * itemsize
        return sum(per_layer * min(n_tokens, self.window(i) or n_tokens)
                   for i in range(self.n_layers))

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> Gemma3Config:
        arch = gf.meta("general.architecture")

        def count(name, default=..., high=LIMITS["size"]):
            return gf.meta_int(f"{arch}.{name}", default, high=high)

        dim = count("embedding_length")
        n_heads = count("attention.head_count", high=LIMITS["heads"])
        n_kv = count("attention.head_count_kv", n_heads, high=LIMITS["heads"])
        head_dim = count("attention.key_length", dim // n_heads)
        if n_heads % n_kv or count("attention.value_length", head_dim) != head_dim \
                or head_dim % 2:
            raise ModelFormatError(f"{gf.path.name}: {n_heads} heads, {n_kv} K/V heads, "
                                   f"head_dim {head_dim}: need n_heads % n_kv_heads == 0, an even "
                                   "head_dim and value_length == key_length")
        embd = gf.tensor("token_embd.weight")
        return cls(
            arch=arch, n_layers=count("block_count", high=LIMITS["layers"]), dim=dim,
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            hidden_dim=count("feed_forward_length"),
            vocab_size=count("vocab_size", int(embd.shape[1]), high=LIMITS["vocab"]),
            context_length=count("context_length", 32768, high=LIMITS["context"]),
            norm_eps=gf.meta_float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, high=1.0),
            rope_theta=gf.meta_float(f"{arch}.rope.freq_base", 1_000_000.0),
            rope_freq_scale=rope_freq_scale(gf, arch),
            sliding_window=count("attention.sliding_window", high=LIMITS["context"]),
            query_scale=1.0 / math.sqrt(query_pre_attn(count("block_count"), dim, n_heads,
                                                       head_dim)),
            final_softcap=float(gf.meta(f"{arch}.final_logit_softcapping", 0.0) or 0.0),
        )


def query_pre_attn(n_layers: int, dim: int, n_heads: int, head_dim: int) -> int:
    """What llama.cpp scales Gemma 3's queries by (1 / sqrt of it): head_dim, except for the
    27B model (62 layers), whose query_pre_attn_scalar is dim / n_heads."""
    return dim // n_heads if n_layers == 62 else head_dim


class _Layer:
    def __init__(self, gf: GGUFFile, i: int, matmul: str):
        p = f"blk.{i}."
        norm = {n: gf.tensor_f32(p + n + ".weight") for n in (
            "attn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "ffn_norm",
            "post_ffw_norm")}
        self.attn_norm, self.q_norm, self.k_norm = (norm["attn_norm"], norm["attn_q_norm"],
                                                    norm["attn_k_norm"])
        self.post_attn_norm, self.ffn_norm = norm["post_attention_norm"], norm["ffn_norm"]
        self.post_ffn_norm = norm["post_ffw_norm"]
        self.wqkv = _fused(gf, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                           matmul)
        self.wo = _weight(gf, p + "attn_output.weight", matmul)
        self.w_gate_up = _fused(gf, [p + "ffn_gate.weight", p + "ffn_up.weight"], matmul)
        self.w_down = _weight(gf, p + "ffn_down.weight", matmul)


class Gemma3Weights:
    """All weights of a Gemma 3 model, quantized as stored in the GGUF; `matmul` is the layers'
    arithmetic, the output head applied with matmul_refined (as for Llama, see LlamaWeights)."""

    def __init__(self, gf: GGUFFile, cfg: Gemma3Config, matmul: str = "float"):
        self.embed, self.output, self.output_norm = embed_and_head(gf, cfg, matmul)
        self.layers = [_Layer(gf, i, matmul) for i in range(cfg.n_layers)]


class Gemma3Model:
    """Config + weights + the forward pass. K/V state is passed in (a `Session`)."""

    def __init__(self, gf: GGUFFile, *, matmul: str = "float"):
        self.config = c = Gemma3Config.from_gguf(gf)
        self.matmul = check_arithmetic(matmul)
        self.weights = Gemma3Weights(gf, c, matmul)
        self.freqs_local = rope_freqs(c.head_dim, theta=LOCAL_ROPE_BASE)
        self.freqs_global = rope_freqs(c.head_dim, theta=c.rope_theta,
                                       freq_scale=c.rope_freq_scale)
        self.embed_scale = np.float32(math.sqrt(c.dim))
        # a single token's layers in a few compiled calls each (models/decode.py)
        self.decode_step = DecodeStep(c, self.decode_layers())

    def decode_layers(self) -> list[DecodeLayer]:
        """The layers as the decode step runs them: QK-norm per head, the local or global
        RoPE tables, scale and sliding window, post-norms around attention and the FFN,
        GeGLU."""
        return [DecodeLayer(attn_norm=lay.attn_norm, qkv=parts(lay.wqkv), bias=None,
                            q_norm=lay.q_norm, k_norm=lay.k_norm, rope=not self.config.is_local(i),
                            options=self.attention_options(i), wo=lay.wo,
                            post_attn_norm=lay.post_attn_norm, ffn_norm=lay.ffn_norm,
                            gate_up=parts(lay.w_gate_up), gelu=True, down=lay.w_down,
                            post_ffn_norm=lay.post_ffn_norm)
                for i, lay in enumerate(self.weights.layers)]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids (T,) -> (T, dim) float32 rows of the embedding table times sqrt(dim)."""
        return self.weights.embed.rows(ids) * self.embed_scale

    def rope(self, positions: np.ndarray):
        """positions (T,) -> {False: local (cos, sin), True: global (cos, sin)}."""
        return {False: rope_cos_sin(positions, self.freqs_local),
                True: rope_cos_sin(positions, self.freqs_global)}

    def qkv(self, layer: int, x: np.ndarray, rope):
        """Layer input x (T, dim) -> q (T, n_heads, hd), k, v (T, n_kv, hd): QK-normed, RoPE'd."""
        c, lay = self.config, self.weights.layers[layer]
        T, hd = x.shape[0], c.head_dim
        qkv = _matmul(lay.wqkv, rms_norm(x, lay.attn_norm, c.norm_eps))
        nq, nkv = c.n_heads * hd, c.n_kv_heads * hd
        q = rms_norm_per_head(qkv[:, :nq].reshape(T, c.n_heads, hd), lay.q_norm, c.norm_eps)
        k = rms_norm_per_head(np.ascontiguousarray(qkv[:, nq:nq + nkv]).reshape(T, c.n_kv_heads,
                                                                                 hd),
                              lay.k_norm, c.norm_eps)
        v = np.ascontiguousarray(qkv[:, nq + nkv:].reshape(T, c.n_kv_heads, hd))
        cos, sin = rope[not c.is_local(layer)]
        return rotate(q, cos, sin, mode=c.rope_mode), rotate(k, cos, sin, mode=c.rope_mode), v

    def head_kv(self, layer: int, head: int, x: np.ndarray, positions: np.ndarray):
        """K, V rows (n, hd) of one K/V head from layer inputs x (n, dim): what `qkv` computes
        for that head (a recompute regenerator's replay; every output row is independent)."""
        _, k, v = self.qkv(layer, x, self.rope(positions))
        return k[:, head], v[:, head]

    # --- the pieces of a layer, shared by forward_chunk and batched_forward -----------------
    def begin_step(self) -> None:
        """Nothing to prepare (no experts)."""

    def attention_inputs(self, layer: int, x: np.ndarray, rope):
        """x (T, dim) -> q (T, n_kv, group, hd), k, v (T, n_kv, hd): `qkv`, q grouped."""
        c = self.config
        q, k, v = self.qkv(layer, x, rope)
        return q.reshape(x.shape[0], c.n_kv_heads, c.group, c.head_dim), k, v

    def attention_options(self, layer: int) -> dict:
        c = self.config
        return {"scale": c.query_scale, "window": c.window(layer)}

    def layer_output(self, layer: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """x + post_attn_norm(wo attn), then + post_ffn_norm(down(gelu(gate) * up)) of
        ffn_norm of that (attn (T, n_heads * hd))."""
        c, lay = self.config, self.weights.layers[layer]
        x = x + rms_norm(lay.wo.matmul(attn), lay.post_attn_norm, c.norm_eps)
        gu = _matmul(lay.w_gate_up, rms_norm(x, lay.ffn_norm, c.norm_eps))
        ffn = lay.w_down.matmul(gated_halves(gu, gelu=True))  # gu: [gate | up]
        return x + rms_norm(ffn, lay.post_ffn_norm, c.norm_eps)

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.weights.output_norm, self.config.norm_eps)

    def head(self, h: np.ndarray) -> np.ndarray:
        """Logits, soft-capped when the file sets final_logit_softcapping."""
        c = self.config
        logits = self.weights.output.matmul_refined(h)
        return softcap(logits, c.final_softcap) if c.final_softcap > 0 else logits

    def forward_batch(self, items: list[BatchItem]) -> list:
        """Several sequences' chunks in one pass -> per item what `forward_chunk` alone returns
        (bitwise), or its exception (`batch.batched_forward`: the weights stream once a
        step)."""
        return batched_forward(self, items)

    def forward_chunk(self, session, ids: np.ndarray, *, all_logits: bool = True,
                      hidden: bool = False, output: bool = True) -> np.ndarray | None:
        """Tokens ids (T,) at positions session.n_tokens ... -> logits (T or 1, vocab) float32,
        or with hidden=True the final normalized hidden states. Appends the chunk's K/V."""
        return forward_layers(self, session, ids, all_logits, hidden, output)
