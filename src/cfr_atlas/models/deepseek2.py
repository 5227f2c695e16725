"""The DeepSeek-V2/V3 family (`deepseek2`): multi-head latent attention (MLA) over one shared
latent K/V stream, leading dense blocks, then MoE blocks with shared experts.

As llama.cpp's deepseek2 graph (src/models/deepseek2.cpp) computes it, per layer, with H heads,
latent rank r (kv_lora_rank), rope dim R, nope dim N = key head dim - R, value head dim Dv:

    h = rms_norm(x)
    q = wq h  (direct)  or  wq_b rms_norm(wq_a h)  (low rank)     (T, H, N + R) = [q_nope; q_pe]
    [c; k_pe] = wkv_a_mqa h                       (T, r + R): latent and the one shared rope key
    q_pe, k_pe = rope(q_pe), rope(k_pe)           NORM pairs, rope slice only, YaRN frequencies
    c = rms_norm(c)                               (attn_kv_a_norm)
    absorbed (queries into latent space):  q_lat[h] = W_kb[h] q_nope[h]   (r,)
    Q[h] = [q_lat[h]; q_pe[h]],  K = [c; k_pe],  V = c  -> o_lat[h] = softmax(s Q[h].K) V   (r,)
    o[h] = W_vb[h] o_lat[h]  (Dv,);   x = x + wo o;   x = x + ffn(rms_norm(x))

The cache holds one stream per layer (one "K/V head"), K rows of width r + R; V is a view of
K's first r columns (AtlasConfig.value_dim = r), so the latent is stored once. This equals the
non-absorbed form (k_nope[h] = W_kb[h]^T c, v[h] = W_vb[h] c per head) by associativity:
q_nope.(W_kb^T c) = (W_kb q_nope).c; tests check it against a float64 reference of that form.
Up-projections come as attn_k_b (H, r, N) and attn_v_b (H, Dv, r), or as the older fused
attn_kv_b (H * (N + Dv), r), transposed once at load. The score scale is llama.cpp's
kq_scale = mscale^2 / sqrt(N + R), mscale = a (1 + yarn_log_multiplier ln(factor)) under YaRN
(the file holds 0.1 x HF's mscale_all_dim: llama.cpp's converter writes it so and its loader
divides it back), a the file's rope.scaling.attn_factor (default 1), which also scales the rope
slice's cos/sin; YaRN's ramp uses beta_fast 32, beta_slow 1 (llama.cpp's context defaults).
The first `leading_dense_block_count` blocks are dense SwiGLU; the rest MoE (moe.py): softmax
or sigmoid gating (+ exp_probs_b for choosing), top-k weights normalized if the file says so,
times expert_weights_scale, plus the shared experts (one dense SwiGLU, added ungated).
This module holds no sampling, tokenization or generation loop; no expert budget (all resident).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import numpy as np

from cfr_atlas.errors import ModelFormatError
from cfr_atlas.experts import POLICIES, ExpertSource, ExpertStore
from cfr_atlas.models.batch import BatchItem, one_by_one
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.models.llama import LIMITS, _weight, embed_and_head
from cfr_atlas.models.llama import _dense as dense_ffn
from cfr_atlas.models.moe import MoeFfn, expert_matrices, link_layers
from cfr_atlas.ops import rms_norm, rope_cos_sin, rope_freqs, rotate, yarn_freqs
from cfr_atlas.quant import QuantWeight
from cfr_atlas.quant.formats import QType
from cfr_atlas.quant.weight import check_arithmetic

ARCH = "deepseek2"
GATING = {0: False, 1: False, 2: True}  # expert_gating_func -> sigmoid? (0: unset = softmax)


@dataclass(frozen=True)
class DeepSeek2Config:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    vocab_size: int
    context_length: int
    norm_eps: float
    q_lora_rank: int  # 0: direct query (attn_q)
    kv_lora_rank: int
    rope_dims: int
    key_head_dim: int  # N + R, per head after decompression
    value_head_dim: int  # Dv
    hidden_dim: int  # dense blocks' SwiGLU width (0 when every block is MoE)
    n_dense_lead: int
    n_experts: int = 0
    n_experts_used: int = 0
    expert_norm: bool = False
    expert_scale: float = 1.0
    sigmoid_gating: bool = False
    rope_theta: float = 10000.0
    yarn: tuple | None = None  # (factor, original context, log_mul, beta_fast, beta_slow)
    attn_factor: float = 1.0
    n_kv_heads: int = 1  # the cache's: one latent stream shared by all heads

    @property
    def head_dim(self) -> int:
        """Width of a cached K row: the latent and the rope key."""
        return self.kv_lora_rank + self.rope_dims

    @property
    def value_dim(self) -> int:
        """V is the first kv_lora_rank columns of each K row (the latent)."""
        return self.kv_lora_rank

    @property
    def nope_dims(self) -> int:
        return self.key_head_dim - self.rope_dims

    @property
    def group(self) -> int:
        return self.n_heads

    @property
    def kq_scale(self) -> float:
        mscale = self.attn_factor
        if self.yarn is not None:
            mscale *= 1.0 + self.yarn[2] * math.log(self.yarn[0])
        return mscale * mscale / math.sqrt(self.key_head_dim)

    def kv_bytes(self, n_tokens: int, itemsize: int = 2) -> int:
        """Bytes of `n_tokens` of cache: one (r + R) row per token and layer, no V copy."""
        return n_tokens * self.n_layers * self.head_dim * itemsize

    def window(self, layer: int) -> int | None:
        return None

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer >= self.n_dense_lead

    @classmethod
    def from_gguf(cls, gf: GGUFFile) -> DeepSeek2Config:
        def count(name, default=..., low=1, high=LIMITS["size"]):
            return gf.meta_int(f"{ARCH}.{name}", default, low=low, high=high)

        def opt(name, key_low=0, high=LIMITS["size"]):  # an optional count, 0 when absent
            return count(name, low=key_low, high=high) if gf.has(f"{ARCH}.{name}") else 0

        n_layers = count("block_count", high=LIMITS["layers"])
        rope_dims = count("rope.dimension_count")
        key = opt("attention.key_length_mla") or count("attention.key_length")
        value = opt("attention.value_length_mla") or count("attention.value_length")
        if rope_dims % 2 or key <= rope_dims:
            raise ModelFormatError(f"{gf.path.name}: rope dims {rope_dims} must be even and "
                                   f"below the key head dim {key} ({ARCH}.attention."
                                   "key_length[_mla] = nope + rope dims)")
        n_experts = opt("expert_count", high=1 << 12)
        if opt("expert_group_count") > 1:
            raise ModelFormatError(f"{gf.path.name}: grouped expert routing "
                                   f"({ARCH}.expert_group_count > 1) is not supported")
        n_lead = opt("leading_dense_block_count", 0, high=n_layers) if n_experts else n_layers
        gating = opt("expert_gating_func", 0, high=8)
        if gating not in GATING:
            raise ModelFormatError(f"{gf.path.name}: {ARCH}.expert_gating_func {gating} is "
                                   "not one of 1 (softmax), 2 (sigmoid)")
        embd = gf.tensor("token_embd.weight")
        return cls(
            arch=ARCH, n_layers=n_layers, dim=count("embedding_length"),
            n_heads=count("attention.head_count", high=LIMITS["heads"]),
            vocab_size=count("vocab_size", gf.meta_len("tokenizer.ggml.tokens")
                             or int(embd.shape[1]), high=LIMITS["vocab"]),
            context_length=count("context_length", 4096, high=LIMITS["context"]),
            norm_eps=gf.meta_float(f"{ARCH}.attention.layer_norm_rms_epsilon", 1e-6, high=1.0),
            q_lora_rank=opt("attention.q_lora_rank", 0),
            kv_lora_rank=count("attention.kv_lora_rank"), rope_dims=rope_dims,
            key_head_dim=key, value_head_dim=value,
            hidden_dim=count("feed_forward_length") if n_lead else 0, n_dense_lead=n_lead,
            n_experts=n_experts,
            n_experts_used=count("expert_used_count", high=n_experts) if n_experts else 0,
            expert_norm=bool(gf.meta(f"{ARCH}.expert_weights_norm", False)),
            expert_scale=gf.meta_float(f"{ARCH}.expert_weights_scale", 1.0),
            sigmoid_gating=GATING[gating],
            rope_theta=gf.meta_float(f"{ARCH}.rope.freq_base", 10000.0),
            yarn=_yarn(gf, count), attn_factor=gf.meta_float(
                f"{ARCH}.rope.scaling.attn_factor", 1.0))


def _yarn(gf: GGUFFile, count) -> tuple | None:
    """(factor, original context, log_mul, beta_fast, beta_slow) for YaRN; None without
    scaling; other scaling types are refused (never ignored)."""
    kind = gf.meta(f"{ARCH}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind != "yarn":
        raise ModelFormatError(f"{gf.path.name}: {ARCH}.rope.scaling.type {kind!r} is not "
                               "supported (supported: none, yarn)")
    log_mul = gf.meta(f"{ARCH}.rope.scaling.yarn_log_multiplier", 0.0)
    if isinstance(log_mul, bool) or not isinstance(log_mul, int | float) \
            or not math.isfinite(log_mul):
        raise ModelFormatError(f"{gf.path.name}: {ARCH}.rope.scaling.yarn_log_multiplier "
                               f"must be a finite number, got {log_mul!r}")
    return (gf.meta_float(f"{ARCH}.rope.scaling.factor"),
            count("rope.scaling.original_context_length", high=LIMITS["context"]),
            float(log_mul), 32.0, 1.0)  # llama.cpp's beta_fast / beta_slow, not read from files


def _per_head(gf: GGUFFile, name: str, n_heads: int, rows: int, cols: int,
              matmul: str) -> list[QuantWeight]:
    """A 3-D tensor (H, rows, cols) (GGUF ne [cols, rows, H]) as one weight per head."""
    t = gf.tensor(name)
    if [int(s) for s in t.shape] != [cols, rows, n_heads]:
        raise ModelFormatError(f"{name} has shape {list(t.shape)}, expected "
                               f"[{cols}, {rows}, {n_heads}]")
    raw = np.asarray(t.data).reshape(n_heads, rows, -1)
    return [QuantWeight.from_gguf(f"{name}[{h}]", t.tensor_type, raw[h], (rows, cols),
                                  arithmetic=matmul) for h in range(n_heads)]


def _up_projections(gf: GGUFFile, c: DeepSeek2Config, p: str, matmul: str):
    """(W_kb per head (r, N), W_vb per head (Dv, r)): attn_k_b / attn_v_b, or the fused
    attn_kv_b (H * (N + Dv), r) split per head and its K part transposed (float32)."""
    H, r, N, Dv = c.n_heads, c.kv_lora_rank, c.nope_dims, c.value_head_dim
    if p + "attn_k_b.weight" in gf.tensors:
        return (_per_head(gf, p + "attn_k_b.weight", H, r, N, matmul),
                _per_head(gf, p + "attn_v_b.weight", H, Dv, r, matmul))
    t = gf.tensor(p + "attn_kv_b.weight")
    if [int(s) for s in t.shape] != [r, H * (N + Dv)]:
        raise ModelFormatError(f"{p}attn_kv_b.weight has shape {list(t.shape)}, expected "
                               f"[{r}, {H * (N + Dv)}]")
    kv_b = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(H, N + Dv, r)
    return ([QuantWeight.from_raw(f"{p}k_b[{h}]", QType.F32,
                                  np.ascontiguousarray(kv_b[h, :N].T), (r, N)) for h in range(H)],
            [QuantWeight.from_raw(f"{p}v_b[{h}]", QType.F32,
                                  np.ascontiguousarray(kv_b[h, N:]), (Dv, r)) for h in range(H)])


class _Layer:
    def __init__(self, gf: GGUFFile, c: DeepSeek2Config, i: int, matmul: str, store):
        p = f"blk.{i}."
        self.attn_norm = gf.tensor_f32(p + "attn_norm.weight")
        if c.q_lora_rank:
            self.wq_a, self.wq_b = _weight(gf, p + "attn_q_a.weight", matmul), \
                _weight(gf, p + "attn_q_b.weight", matmul)
            self.q_a_norm = gf.tensor_f32(p + "attn_q_a_norm.weight")
        else:
            self.wq = _weight(gf, p + "attn_q.weight", matmul)
        self.wkv_a = _weight(gf, p + "attn_kv_a_mqa.weight", matmul)
        if self.wkv_a.shape != (c.head_dim, c.dim):
            raise ModelFormatError(f"{p}attn_kv_a_mqa.weight is {self.wkv_a.shape}, expected "
                                   f"({c.head_dim}, {c.dim}) (kv_lora_rank + rope dims, dim)")
        self.kv_a_norm = gf.tensor_f32(p + "attn_kv_a_norm.weight")
        self.w_kb, self.w_vb = _up_projections(gf, c, p, matmul)
        self.wo = _weight(gf, p + "attn_output.weight", matmul)
        self.ffn_norm = gf.tensor_f32(p + "ffn_norm.weight")
        self.ffn = _moe(gf, c, i, matmul, store) if c.is_moe(i) else dense_ffn(gf, p, matmul)


def _moe(gf: GGUFFile, c: DeepSeek2Config, i: int, matmul: str, store) -> MoeFfn:
    p = f"blk.{i}."
    router = _weight(gf, p + "ffn_gate_inp.weight", "float")
    bias = gf.tensor_f32(p + "exp_probs_b.bias") if p + "exp_probs_b.bias" in gf.tensors \
        else None
    shared = dense_ffn(gf, p, matmul, "_shexp") if p + "ffn_up_shexp.weight" in gf.tensors \
        else None
    routing = {"scale": c.expert_scale, "sigmoid": c.sigmoid_gating, "bias": bias}
    return MoeFfn(i - c.n_dense_lead, router, c.n_experts_used, c.expert_norm, store, shared,
                  routing=routing)  # the store numbers MoE layers from 0


def expert_store(gf: GGUFFile, c: DeepSeek2Config, matmul: str) -> ExpertStore | None:
    """Every routed expert resident (the MoE layers' matrices, numbered from 0)."""
    if not c.n_experts:
        return None
    layers = [expert_matrices(gf, i, c.dim) for i in range(c.n_dense_lead, c.n_layers)]
    source = ExpertSource(layers, matmul, gf.path, gf.version())
    if source.n_experts != c.n_experts:
        raise ModelFormatError(f"{gf.path.name}: expert tensors hold {source.n_experts} "
                               f"experts, metadata {ARCH}.expert_count says {c.n_experts}")
    return ExpertStore(source, None, POLICIES["lru"]())


class DeepSeek2Model:
    """Config + weights + the forward pass. K/V state is passed in (a `Session`)."""

    decode_step = None  # no decode step (models/decode.py): MLA and MoE take their own pass

    def __init__(self, gf: GGUFFile, *, matmul: str = "float"):
        self.config = c = DeepSeek2Config.from_gguf(gf)
        self.matmul = check_arithmetic(matmul)
        self.experts = expert_store(gf, c, matmul)
        self.embed_w, self.output, self.output_norm = embed_and_head(gf, c, matmul)
        self.layers = [_Layer(gf, c, i, matmul, self.experts) for i in range(c.n_layers)]
        link_layers([lay.ffn for lay in self.layers])
        if c.yarn is None:
            self.freqs = rope_freqs(c.rope_dims, theta=c.rope_theta)
        else:
            factor, orig, _, fast, slow = c.yarn
            self.freqs = yarn_freqs(c.rope_dims, theta=c.rope_theta, freq_scale=1.0 / factor,
                                    n_ctx_orig=orig, beta_fast=fast, beta_slow=slow)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        return self.embed_w.rows(ids)

    def rope(self, positions: np.ndarray):
        """positions (T,) -> (cos, sin) (T, R / 2) float32, times the attention factor."""
        cos, sin = rope_cos_sin(positions, self.freqs)
        a = np.float32(self.config.attn_factor)
        return (cos, sin) if a == 1 else (cos * a, sin * a)

    def _latent_rows(self, lay: _Layer, h: np.ndarray, rope) -> np.ndarray:
        """Normed layer input h (T, dim) -> cached K rows (T, r + R): [rms_norm(c); rope(k_pe)]."""
        c = self.config
        kv = lay.wkv_a.matmul(h)
        k = np.empty_like(kv)
        k[:, :c.kv_lora_rank] = rms_norm(np.ascontiguousarray(kv[:, :c.kv_lora_rank]),
                                         lay.kv_a_norm, c.norm_eps)
        pe = np.ascontiguousarray(kv[:, c.kv_lora_rank:]).reshape(len(h), 1, c.rope_dims)
        k[:, c.kv_lora_rank:] = rotate(pe, *rope, mode="normal")[:, 0]
        return k

    def head_kv(self, layer: int, head: int, x: np.ndarray, positions: np.ndarray):
        """K rows (n, r + R) and V rows (n, 0) (V views K) of the latent stream from layer
        inputs x (n, dim): what `forward_chunk` stores (a recompute regenerator's replay)."""
        lay = self.layers[layer]
        h = rms_norm(x, lay.attn_norm, self.config.norm_eps)
        return self._latent_rows(lay, h, self.rope(positions)), np.empty((len(x), 0), np.float32)

    def _queries(self, lay: _Layer, h: np.ndarray, rope) -> np.ndarray:
        """h (T, dim) -> absorbed queries (T, 1, H, r + R): [W_kb[h] q_nope[h]; rope(q_pe[h])]."""
        c, T = self.config, len(h)
        if c.q_lora_rank:
            q = lay.wq_b.matmul(rms_norm(lay.wq_a.matmul(h), lay.q_a_norm, c.norm_eps))
        else:
            q = lay.wq.matmul(h)
        q = q.reshape(T, c.n_heads, c.key_head_dim)
        out = np.empty((T, 1, c.n_heads, c.head_dim), dtype=np.float32)
        for hd in range(c.n_heads):  # queries into latent space, head by head
            out[:, 0, hd, :c.kv_lora_rank] = lay.w_kb[hd].matmul(
                np.ascontiguousarray(q[:, hd, :c.nope_dims]))
        pe = np.ascontiguousarray(q[:, :, c.nope_dims:])
        out[:, 0, :, c.kv_lora_rank:] = rotate(pe, *rope, mode="normal")
        return out

    def _attention(self, session, i: int, lay: _Layer, x: np.ndarray, pos0: int, rope):
        """One layer's attention for rows x (T, dim) -> wo o (T, dim); stores the latent rows."""
        c, T = self.config, len(x)
        h = rms_norm(x, lay.attn_norm, c.norm_eps)
        o_lat = session.store_attend(i, pos0, x, self._latent_rows(lay, h, rope)[:, None],
                                     np.empty((T, 1, 0), dtype=np.float32),
                                     self._queries(lay, h, rope), scale=c.kq_scale)
        o = np.empty((T, c.n_heads * c.value_head_dim), dtype=np.float32)
        for hd in range(c.n_heads):  # values out of latent space
            o[:, hd * c.value_head_dim:(hd + 1) * c.value_head_dim] = lay.w_vb[hd].matmul(
                np.ascontiguousarray(o_lat[:, 0, hd]))
        return lay.wo.matmul(o)

    def forward_chunk(self, session, ids: np.ndarray, *, all_logits: bool = True,
                      hidden: bool = False, output: bool = True) -> np.ndarray | None:
        """Tokens ids (T,) at positions session.n_tokens ... -> logits (T or 1, vocab) float32,
        or with hidden=True the final normalized hidden states. Appends the chunk's latents."""
        c, T, pos0 = self.config, ids.shape[0], session.n_tokens
        if self.experts is not None:
            self.experts.begin_step()
        rope = self.rope(np.arange(pos0, pos0 + T, dtype=np.int64))
        x = self.embed(ids)
        for i, lay in enumerate(self.layers):
            x = x + self._attention(session, i, lay, x, pos0, rope)  # h = x + attention(norm(x))
            x = x + lay.ffn(rms_norm(x, lay.ffn_norm, c.norm_eps))  # x = h + ffn(norm(h))
        session.advance(ids)
        if not output:
            return None
        x = rms_norm(x if all_logits else x[-1:], self.output_norm, c.norm_eps)
        return x if hidden else self.output.matmul_refined(x)

    def forward_batch(self, items: list[BatchItem]) -> list:
        """Items one after another (exact; the weights stream once per item)."""
        return one_by_one(self, items)
