"""The Llama family (llama, qwen2, and the MoE archs qwen2moe, qwen3moe, olmoe, Mixtral-style
llama with expert_count > 0): config from GGUF metadata, weights, the forward pass.

One frozen `LlamaConfig` built in one place from metadata; `LlamaWeights` loads quantized
matrices as `QuantWeight`s (never expanded to float32) and fuses Q|K|V and gate|up visibly, by
concatenating their quantized rows when they share a format. `forward_chunk` is the whole
transformer for a chunk of tokens, top to bottom, with every attention call going through the
caller's `Atlas` (the model's K/V lives there and in the session's regenerator).
`forward_batch` is the same pass for several sequences at once; both are made of the per-layer
pieces `attention_inputs`, `attention_options`, `layer_output` (models/batch.py).

Architecture differences (RoPE convention, Q/K/V biases, rope_freqs, QK-norm) live in `ARCHS`,
not as branches in a loader; the feed-forward block (dense or MoE, models/moe.py) is one object
per layer, `lay.ffn`. QK-norm: "head" normalizes each head (qwen3moe), "full" the whole Q and K
projections (olmoe), both before RoPE as llama.cpp does. RoPE scaling follows llama.cpp: linear
`rope.scaling.factor`, and the per-pair `rope_freqs.weight` divisors of Llama 3.1/3.2; YaRN and
unknown types are refused.
This module holds no sampling, tokenization or generation loop.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import ConfigError, ModelFormatError, UnsupportedArchitectureError
from cfr_atlas.models.batch import BatchItem, batched_forward, forward_layers
from cfr_atlas.models.decode import DecodeLayer, DecodeStep, parts
from cfr_atlas.models.expert_memory import build_store, parse_expert_budget, resident_estimate
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.models.moe import NORM_TOPK, DenseFfn, MoeFfn, link_layers
from cfr_atlas.models.recompute import kv_head_weights
from cfr_atlas.ops import rms_norm, rope_cos_sin, rope_freqs, rotate
from cfr_atlas.ops.norm import rms_norm_per_head
from cfr_atlas.quant import QuantWeight
from cfr_atlas.quant.formats import QType
from cfr_atlas.quant.weight import check_arithmetic

# per architecture: RoPE convention (llama.cpp's converter permutes llama Q/K rows so that
# adjacent pairs rotate; qwen2 keeps HF's split halves), whether Q/K/V carry biases, and whether
# llama.cpp reads the optional `rope_freqs.weight` (Llama 3.1/3.2 store their scaling there).
# MoE archs (moe=True) need expert_count > 0; llama may have experts (Mixtral) or not.
ARCHS = {
    "llama": {"rope_mode": "normal", "qkv_bias": False, "rope_freqs": True},
    "qwen2": {"rope_mode": "neox", "qkv_bias": True, "rope_freqs": False},
    "qwen2moe": {"rope_mode": "neox", "qkv_bias": True, "rope_freqs": False, "moe": True},
    "qwen3moe": {"rope_mode": "neox", "qkv_bias": False, "rope_freqs": False, "moe": True,
                 "qk_norm": "head"},
    "olmoe": {"rope_mode": "neox", "qkv_bias": False, "rope_freqs": False, "moe": True,
              "qk_norm": "full"},
}
# `rope.scaling.type` values we implement, as llama.cpp does: absent means "linear" (a no-op
# without a factor). "llama3" is no runtime type in llama.cpp: its converter bakes Llama 3.1's
# scaling into rope_freqs.weight. YaRN, LongRoPE and anything else are refused, never ignored.
ROPE_SCALINGS = ("none", "linear")
ROPE_FREQS = "rope_freqs.weight"

# Upper bounds for metadata counts: far above any real model, low enough that a corrupt value
# is refused before it sizes an allocation.
LIMITS = {"size": 1 << 20, "heads": 1 << 12, "layers": 1 << 12, "vocab": 1 << 22,
          "context": 1 << 24}


@dataclass(frozen=True)
class LlamaConfig:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_theta: float
    rope_dims: int
    rope_mode: str
    rope_freq_scale: float
    qkv_bias: bool
    key_length: int = 0  # head_dim when the file sets attention.key_length (qwen3moe)
    n_experts: int = 0  # 0: a dense model
    n_experts_used: int = 0
    qk_norm: str | None = None  # None, "head" or "full"

    @property
    def head_dim(self) -> int:
        return self.key_length or self.dim // self.n_heads

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads

    @property
    def value_dim(self) -> None:
        """V rows are stored beside K (not a view of K, as MLA's latent is)."""
        return None

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """K + V bytes one token adds across all layers (2 = float16, the default storage)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize

    def kv_bytes(self, n_tokens: int, itemsize: int = 2) -> int:
        """K + V bytes a context of `n_tokens` needs (every layer holds every token)."""
        return n_tokens * self.kv_bytes_per_token(itemsize)

    def window(self, layer: int) -> int | None:
        """Keys a query of `layer` sees: None, the whole causal context (no sliding window)."""
        return None

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> LlamaConfig:
        arch = gf.meta("general.architecture")
        if arch not in ARCHS:
            raise UnsupportedArchitectureError(
                f"{gf.path.name}: architecture {arch!r} is not supported "
                f"(supported: {', '.join(sorted(ARCHS))})")

        def key(name, default=...):
            return gf.meta(f"{arch}.{name}", default)

        def count(name, default=..., high=LIMITS["size"]):  # a ModelFormatError names the key
            return gf.meta_int(f"{arch}.{name}", default, high=high)

        def real(name, default, high=math.inf):
            return gf.meta_float(f"{arch}.{name}", default, high=high)

        dim = count("embedding_length")
        n_heads = count("attention.head_count", high=LIMITS["heads"])
        n_kv = count("attention.head_count_kv", n_heads, high=LIMITS["heads"])
        key_length = count("attention.key_length", 0, high=LIMITS["size"]) \
            if gf.has(f"{arch}.attention.key_length") else 0
        if (dim % n_heads and not key_length) or n_heads % n_kv:
            raise ModelFormatError(f"{gf.path.name}: dim {dim}, {n_heads} heads and {n_kv} K/V "
                                   f"heads do not divide evenly ({arch}.embedding_length must "
                                   "be a multiple of attention.head_count, and that of "
                                   "attention.head_count_kv)")
        head_dim = key_length or dim // n_heads
        rope_dims = count("rope.dimension_count", head_dim, high=head_dim)
        if rope_dims % 2:
            raise ModelFormatError(f"{gf.path.name}: metadata {arch}.rope.dimension_count = "
                                   f"{rope_dims} is odd (RoPE rotates pairs)")
        embd = gf.tensor("token_embd.weight")
        vocab = count("vocab_size", gf.meta_len("tokenizer.ggml.tokens")
                      or int(embd.shape[1]), high=LIMITS["vocab"])
        n_experts, n_used = _expert_counts(gf, arch, count)
        return cls(
            arch=arch, n_layers=count("block_count", high=LIMITS["layers"]), dim=dim,
            n_heads=n_heads, n_kv_heads=n_kv,
            hidden_dim=count("feed_forward_length") if gf.has(f"{arch}.feed_forward_length")
            or not n_experts else 0,
            vocab_size=vocab, context_length=count("context_length", 4096,
                                                   high=LIMITS["context"]),
            norm_eps=real("attention.layer_norm_rms_epsilon", 1e-5, high=1.0),
            rope_theta=real("rope.freq_base", 10000.0),
            rope_dims=rope_dims,
            rope_mode=ARCHS[arch]["rope_mode"], rope_freq_scale=rope_freq_scale(gf, arch),
            qkv_bias=ARCHS[arch]["qkv_bias"], key_length=key_length, n_experts=n_experts,
            n_experts_used=n_used, qk_norm=ARCHS[arch].get("qk_norm"),
        )


def _expert_counts(gf: GGUFFile, arch: str, count) -> tuple[int, int]:
    """(expert_count, expert_used_count): (0, 0) for a dense model; an MoE arch without
    experts, or more used than there are, is a ModelFormatError."""
    n = count("expert_count", 0, high=1 << 12) if gf.has(f"{arch}.expert_count") else 0
    if not n:
        if ARCHS[arch].get("moe"):
            raise ModelFormatError(f"{gf.path.name}: {arch} needs {arch}.expert_count > 0")
        return 0, 0
    used = count("expert_used_count", high=n)
    return n, used


def rope_freq_scale(gf: GGUFFile, arch: str) -> float:
    """RoPE frequency multiplier as llama.cpp derives it: 1 / `rope.scaling.factor` (or the old
    `rope.scale_linear`) for linear scaling, 0 or absent meaning 1; 1 for type "none"."""
    kind = gf.meta(f"{arch}.rope.scaling.type", "linear")
    if kind not in ROPE_SCALINGS:
        raise ModelFormatError(
            f"{gf.path.name}: {arch}.rope.scaling.type {kind!r} is not supported (supported: "
            f"{', '.join(ROPE_SCALINGS)}; Llama 3.1 scaling comes as {ROPE_FREQS})")
    factor = gf.meta(f"{arch}.rope.scaling.factor", gf.meta(f"{arch}.rope.scale_linear", 0.0))
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not (
            math.isfinite(factor) and factor >= 0):
        raise ModelFormatError(f"{gf.path.name}: {arch}.rope.scaling.factor must be a finite "
                               f"number >= 0, got {factor!r}")
    return 1.0 if kind == "none" or factor == 0 else 1.0 / float(factor)


def rope_freq_factors(gf: GGUFFile, cfg: LlamaConfig) -> np.ndarray | None:
    """`rope_freqs.weight` (rope_dims / 2,) float32: llama.cpp divides pair i's frequency by
    entry i (ggml_rope_ext's freq_factors). None when the file has none."""
    if ROPE_FREQS not in gf.tensors:
        return None
    if not ARCHS[cfg.arch]["rope_freqs"]:
        raise ModelFormatError(f"{gf.path.name}: {cfg.arch} does not use {ROPE_FREQS}, but the "
                               "file has one")
    ff = gf.tensor_f32(ROPE_FREQS)
    if ff.shape != (cfg.rope_dims // 2,) or not np.all(np.isfinite(ff) & (ff > 0)):
        raise ModelFormatError(
            f"{gf.path.name}: {ROPE_FREQS} must hold {cfg.rope_dims // 2} finite entries > 0 "
            f"(rope dims {cfg.rope_dims} / 2), got {ff.shape[0]}: {ff[:8].tolist()}")
    return ff


def _weight(gf: GGUFFile, name: str, matmul: str) -> QuantWeight:
    t = gf.tensor(name)
    n_rows, n_cols = int(t.shape[1]), int(t.shape[0])  # GGUF lists dims innermost first
    return QuantWeight.from_gguf(name, t.tensor_type, t.data, (n_rows, n_cols),
                                 arithmetic=matmul, repack=_repack(gf))


def _fused(gf: GGUFFile, names: list[str], matmul: str) -> QuantWeight | list[QuantWeight]:
    """One QuantWeight over the stacked rows of `names` when they share a format (one kernel
    call instead of several); the separate weights otherwise."""
    ts = [gf.tensor(n) for n in names]
    if len({t.tensor_type for t in ts}) != 1 or len({int(t.shape[0]) for t in ts}) != 1:
        return [_weight(gf, n, matmul) for n in names]
    raw = np.concatenate([np.asarray(t.data).reshape(int(t.shape[1]), -1) for t in ts])
    rows = sum(int(t.shape[1]) for t in ts)
    return QuantWeight.from_gguf("+".join(names), ts[0].tensor_type, raw,
                                 (rows, int(ts[0].shape[0])), arithmetic=matmul,
                                 repack=_repack(gf))


def _repack(gf: GGUFFile):
    """Where the file's repacked tiles come from: its tile cache, or None (repack each)."""
    return None if gf.tile_cache is None else gf.tile_cache.repack


class _Layer:
    def __init__(self, gf: GGUFFile, cfg: LlamaConfig, i: int, matmul: str, store=None):
        p = f"blk.{i}."
        self.attn_norm = gf.tensor_f32(p + "attn_norm.weight")
        self.ffn_norm = gf.tensor_f32(p + "ffn_norm.weight")
        self.q_norm = gf.tensor_f32(p + "attn_q_norm.weight") if cfg.qk_norm else None
        self.k_norm = gf.tensor_f32(p + "attn_k_norm.weight") if cfg.qk_norm else None
        self.wqkv = _fused(gf, [p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"],
                           matmul)
        self.bqkv = (np.concatenate([gf.tensor_f32(p + f"attn_{x}.bias") for x in "qkv"])
                     if cfg.qkv_bias else None)
        self.wo = _weight(gf, p + "attn_output.weight", matmul)
        self.ffn = _moe(gf, cfg, i, matmul, store) if cfg.n_experts else _dense(gf, p, matmul)


def _dense(gf: GGUFFile, p: str, matmul: str, kind: str = "") -> DenseFfn:
    """The SwiGLU block of tensors ffn_{gate,up,down}{kind} (kind "_shexp": a shared expert)."""
    gu = _fused(gf, [p + f"ffn_gate{kind}.weight", p + f"ffn_up{kind}.weight"], matmul)
    down = _weight(gf, p + f"ffn_down{kind}.weight", matmul)
    return DenseFfn(gu, down, down.shape[1], _matmul)  # hidden_dim: down's columns


def _moe(gf: GGUFFile, cfg: LlamaConfig, i: int, matmul: str, store) -> MoeFfn:
    p = f"blk.{i}."
    router = _weight(gf, p + "ffn_gate_inp.weight", "float")
    if router.shape != (cfg.n_experts, cfg.dim):
        raise ModelFormatError(f"{p}ffn_gate_inp.weight is {router.shape}, expected "
                               f"({cfg.n_experts}, {cfg.dim})")
    shared = shared_gate = None
    if p + "ffn_gate_inp_shexp.weight" in gf.tensors:  # qwen2moe's gated shared expert
        shared = _dense(gf, p, matmul, "_shexp")
        g = gf.tensor_f32(p + "ffn_gate_inp_shexp.weight")
        shared_gate = QuantWeight.from_raw(p + "ffn_gate_inp_shexp", QType.F32,
                                           g.reshape(1, -1), (1, cfg.dim))
    return MoeFfn(i, router, cfg.n_experts_used, NORM_TOPK[cfg.arch], store, shared,
                  shared_gate)


def _matmul(w, x: np.ndarray) -> np.ndarray:
    """x (T, K) through a fused weight or a list of weights whose outputs concatenate."""
    if isinstance(w, list):
        return np.concatenate([wi.matmul(x) for wi in w], axis=1)
    return w.matmul(x)


def embed_and_head(gf: GGUFFile, cfg, matmul: str = "float"
                   ) -> tuple[QuantWeight, QuantWeight, np.ndarray]:
    """The token embedding (checked against vocab_size x dim), the output head (the embedding
    when the file ties them: one copy) and the final norm, both in the layers' arithmetic. Row
    reads give the same bits in either; the head is applied with `matmul_refined` (LlamaWeights)."""
    embed = _weight(gf, "token_embd.weight", matmul)
    if embed.shape != (cfg.vocab_size, cfg.dim):
        raise ModelFormatError(f"token_embd.weight is {embed.shape}, expected "
                               f"({cfg.vocab_size}, {cfg.dim})")
    output = (_weight(gf, "output.weight", matmul) if "output.weight" in gf.tensors
              else embed)
    return embed, output, gf.tensor_f32("output_norm.weight")


class LlamaWeights:
    """All weights of a Llama-family model, quantized as stored in the GGUF; matmul names the
    arithmetic of the products ("float" or "int8", see quant.weight.ARITHMETIC). Under int8 the
    output head takes `QuantWeight.matmul_refined` (~15-bit activations in two integer passes):
    plain 8-bit activations there cost argmax agreement with HF (96.9% against 97.2% over 900
    positions of the bundled model, measured), while the head is most of a decode token's
    weight bytes in files with large vocabularies (Gemma 3: 63%)."""

    def __init__(self, gf: GGUFFile, cfg: LlamaConfig, matmul: str = "float", store=None):
        self.embed, self.output, self.output_norm = embed_and_head(gf, cfg, matmul)
        self.layers = [_Layer(gf, cfg, i, matmul, store) for i in range(cfg.n_layers)]
        link_layers([lay.ffn for lay in self.layers])

    @property
    def nbytes(self) -> int:
        """Bytes of the resident weights; routed experts are the expert store's (pool_bytes)."""
        ws = [self.embed, self.output]
        for lay in self.layers:
            for w in (lay.wqkv, lay.wo):
                ws.extend(w if isinstance(w, list) else [w])
            ffn = lay.ffn
            if isinstance(ffn, MoeFfn):
                ws.append(ffn.router)
                ffn = ffn.shared
            ws.extend(ffn.weights() if ffn is not None else [])
        return sum(w.nbytes for w in {id(w): w for w in ws}.values())


class LlamaModel:
    """Config + weights + the forward pass. K/V state is passed in (a `Session`)."""

    def __init__(self, gf: GGUFFile, *, matmul: str = "float", expert_budget: int | None = None,
                 expert_policy: str = "lru", routing_profile: dict | None = None,
                 expert_reads: str = "auto"):
        self.config = LlamaConfig.from_gguf(gf)
        self.matmul = check_arithmetic(matmul)
        self._gf = gf
        self._expert_args = (expert_budget, expert_policy, routing_profile, expert_reads)
        # the resident weights are allocated after the store: "auto" reads count them
        self.experts = build_store(gf, self.config, matmul, *self._expert_args,
                                   later=resident_estimate(gf))
        self.weights = LlamaWeights(gf, self.config, matmul, self.experts)
        c = self.config
        self.rope_freqs = rope_freqs(c.rope_dims, theta=c.rope_theta,
                                     freq_scale=c.rope_freq_scale,
                                     freq_factors=rope_freq_factors(gf, c))
        # per-head K/V projections for exact recomputation (a copy of the K/V rows only),
        # repacked when a recompute first asks for a layer's: a generation without the
        # recompute regenerator never pays for them (~6% of the bundled model's repack)
        self._kv_weights: list[list | None] = [None] * c.n_layers
        # a single token's layers in a few compiled calls each (None: forward_layers' pieces)
        layers = self.decode_layers()
        self.decode_step = None if layers is None else DecodeStep(c, layers)

    def decode_layers(self) -> list[DecodeLayer] | None:
        """The layers as the decode step runs them (models/decode.py): dense models without
        QK-norm whose FFNs share one hidden size; None for the others."""
        c, layers = self.config, self.weights.layers
        if c.n_experts or c.qk_norm or not all(
                isinstance(lay.ffn, DenseFfn) and lay.ffn.hidden_dim == layers[0].ffn.hidden_dim
                for lay in layers):
            return None
        return [DecodeLayer(attn_norm=lay.attn_norm, qkv=parts(lay.wqkv), bias=lay.bqkv,
                            q_norm=None, k_norm=None, rope=None, options={}, wo=lay.wo,
                            post_attn_norm=None, ffn_norm=lay.ffn_norm,
                            gate_up=parts(lay.ffn.w_gate_up), gelu=False, down=lay.ffn.w_down,
                            post_ffn_norm=None) for lay in layers]

    def set_experts(self, budget=None, policy: str = "lru", profile: dict | None = None,
                    reads: str = "auto"):
        """Replace the expert store (a new budget, policy or way of reading) without reloading
        the model; the old pool is released. budget as load_model's expert_budget, reads as its
        expert_reads. -> the new ExpertStore."""
        if not self.config.n_experts:
            raise ConfigError("expert_budget", f"this {self.config.arch} model has no experts")
        budget = parse_expert_budget(budget)
        if self.experts is not None:
            self.experts.source.close()
        self._use_store(None)  # drop the old pool before the new one is allocated
        try:
            store = build_store(self._gf, self.config, self.matmul, budget, policy, profile,
                                reads)
        except Exception:  # refused (budget, host memory): the model keeps its old settings
            self._use_store(build_store(self._gf, self.config, self.matmul, *self._expert_args))
            raise
        self._expert_args = (budget, policy, profile, reads)
        self._use_store(store)
        return store

    def _use_store(self, store) -> None:
        for lay in self.weights.layers:
            lay.ffn.store = store
        self.experts = store

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids (T,) -> (T, dim) float32 rows of the embedding table."""
        return self.weights.embed.rows(ids)

    def rope(self, positions: np.ndarray):
        """positions (T,) -> (cos, sin) tables, a pure function of each position."""
        return rope_cos_sin(positions, self.rope_freqs)

    def qkv(self, layer: int, x: np.ndarray, rope):
        """Layer input x (T, dim), rope = self.rope(positions) -> q (T, n_heads, hd), k, v
        (T, n_kv, hd), RoPE applied.

        This is also what a recompute regenerator replays: the same kernels on the same rows.
        """
        c, lay = self.config, self.weights.layers[layer]
        h = rms_norm(x, lay.attn_norm, c.norm_eps)
        qkv = _matmul(lay.wqkv, h)
        if lay.bqkv is not None:
            qkv += lay.bqkv
        T, hd, nq, nkv = x.shape[0], c.head_dim, c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        q = qkv[:, :nq].reshape(T, c.n_heads, hd)
        k = qkv[:, nq:nq + nkv].reshape(T, c.n_kv_heads, hd)
        v = np.ascontiguousarray(qkv[:, nq + nkv:].reshape(T, c.n_kv_heads, hd))
        if c.qk_norm == "full":  # olmoe: over the whole projection
            q = rms_norm(np.ascontiguousarray(q.reshape(T, nq)), lay.q_norm, c.norm_eps)
            k = rms_norm(np.ascontiguousarray(k.reshape(T, nkv)), lay.k_norm, c.norm_eps)
            q, k = q.reshape(T, c.n_heads, hd), k.reshape(T, c.n_kv_heads, hd)
        elif c.qk_norm == "head":  # qwen3moe: each head on its own
            q = rms_norm_per_head(np.ascontiguousarray(q), lay.q_norm, c.norm_eps)
            k = rms_norm_per_head(np.ascontiguousarray(k), lay.k_norm, c.norm_eps)
        cos, sin = rope
        q = rotate(np.ascontiguousarray(q), cos, sin, mode=c.rope_mode)
        k = rotate(np.ascontiguousarray(k), cos, sin, mode=c.rope_mode)
        return q, k, v

    def kv_weights(self, layer: int) -> list:
        """Per K/V head of `layer`: (weight over its K and V rows, bias), see kv_head_weights;
        repacked on the first call (two racing threads would repack the same bits twice)."""
        if self._kv_weights[layer] is None:
            self._kv_weights[layer] = kv_head_weights(self._gf, self.config, layer, self.matmul)
        return self._kv_weights[layer]

    def head_kv(self, layer: int, head: int, x: np.ndarray, positions: np.ndarray):
        """K, V rows (n, hd) of one K/V head from layer inputs x (n, dim), as `qkv` computes
        them: RMSNorm, that head's K/V weight rows (+ bias), RoPE (a recompute replay)."""
        c = self.config
        if c.qk_norm:  # the norm needs the whole projection (olmoe) or is simplest replayed so
            _, k, v = self.qkv(layer, x, self.rope(positions))
            return k[:, head], np.ascontiguousarray(v[:, head])
        h = rms_norm(x, self.weights.layers[layer].attn_norm, c.norm_eps)
        w, b = self.kv_weights(layer)[head]
        kv = _matmul(w, h)
        if b is not None:
            kv += b
        k = np.ascontiguousarray(kv[:, :c.head_dim]).reshape(len(x), 1, c.head_dim)
        cos, sin = self.rope(positions)
        return rotate(k, cos, sin, mode=c.rope_mode)[:, 0], kv[:, c.head_dim:]

    # --- the pieces of a layer, shared by forward_chunk and batched_forward -----------------
    def begin_step(self) -> None:
        if self.experts is not None:
            self.experts.begin_step()

    def attention_inputs(self, layer: int, x: np.ndarray, rope):
        """x (T, dim) -> q (T, n_kv, group, hd), k, v (T, n_kv, hd): `qkv`, q grouped."""
        c = self.config
        q, k, v = self.qkv(layer, x, rope)
        return q.reshape(x.shape[0], c.n_kv_heads, c.group, c.head_dim), k, v

    def attention_options(self, layer: int) -> dict:
        return {}  # the Atlas's defaults: scale head_dim^-0.5, causal, no window

    def layer_output(self, layer: int, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """h = x + wo attn;  h + ffn(norm(h)) (attn (T, n_heads * hd))."""
        lay = self.weights.layers[layer]
        x = x + lay.wo.matmul(attn)
        return x + lay.ffn(rms_norm(x, lay.ffn_norm, self.config.norm_eps))

    def final_norm(self, x: np.ndarray) -> np.ndarray:
        return rms_norm(x, self.weights.output_norm, self.config.norm_eps)

    def head(self, h: np.ndarray) -> np.ndarray:
        return self.weights.output.matmul_refined(h)

    def forward_chunk(self, session, ids: np.ndarray, *, all_logits: bool = True,
                      hidden: bool = False, output: bool = True) -> np.ndarray | None:
        """Tokens ids (T,) at positions session.n_tokens ... -> logits (T or 1, vocab) float32,
        or with hidden=True the final normalized hidden states (T or 1, dim).

        Appends the chunk's K/V to the session. Every row's arithmetic is independent of T.
        output=False skips the output head (a prefill chunk whose logits nobody reads): None.
        """
        return forward_layers(self, session, ids, all_logits, hidden, output)

    def forward_batch(self, items: list[BatchItem]) -> list:
        """Several sequences' chunks in one pass -> per item exactly what `forward_chunk` of
        that item alone returns (bitwise), or the exception that item raised
        (`batch.batched_forward`)."""
        return batched_forward(self, items)
