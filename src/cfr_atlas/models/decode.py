"""The decode step: one token through a dense decoder's layers in a few compiled calls per
layer, for the Llama family (dense, no QK-norm) and Gemma 3.

`forward_layers` builds a layer from the family's pieces (`attention_inputs`, the session's
`store_attend`, `layer_output`), each made of checked public ops: about 280 Python calls a layer,
4-5 ms of a bundled-model token. For a single token, `DecodeStep` runs the same arithmetic on
preallocated buffers, layer by layer, from a description the family gives (`DecodeLayer`):

    residual_norm   x += d (the previous layer's output, post-normed where the family has a
                    post-FFN norm), h = rms_norm(x)                      (layer 0: rms_norm)
    product         qkv = h Wqkv^T             (the weight's own kernel, `QuantWeight.product`)
    qkv_rows        + bias; per-head QK-norm (Gemma 3); q and k rotated; k, v rounded to the
                    storage dtype and checked
    decode_attend   the session's regenerator copy, then the hot-cache append and fold (with the
                    layer's attention options: Gemma 3's scale and sliding window)
    product         o = attn Wo^T
    residual_norm   x += o (post-normed: Gemma 3), h = rms_norm(x)
    product         gu = h Wgu^T
    gated_rows      a = act(gu[:hid]) * gu[hid:], act SiLU (SwiGLU) or tanh-GELU (GeGLU)
    product         d = a Wdown^T

Each kernel calls the kernels of the ops it stands for (ops/norm.py's RMS norm, ops/rope.py's
rotation, ops/activations.py's silu and gelu, atlas/storage.py's rounding and check) on the same
values, and the residual adds are the same float32 adds, so every bit is that of
`forward_layers`: the tests hold the two to np.array_equal over weight formats, both
arithmetics, every storage dtype, budgets, regenerators, page boundaries and sliding windows.
What the compiled walk does not cover takes the general calls inside the layer: rows that are
not storable, or a query that is not finite, go through `Session.store_attend` (which raises
what it raises); a new page, a miss or a budget that evicts go through `Atlas.write_attend`
(`Session.decode_attend`).

A family offers the step through `decode_layers()` (None: every token takes `forward_layers`):
Llama-family models without experts or QK-norm, and Gemma 3. MoE models, QK-norm Llama archs
(qwen3moe, olmoe) and DeepSeek2 have none.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import numpy as np
from numba import njit

from cfr_atlas.atlas.storage import format_of, round_checked
from cfr_atlas.ops.activations import _gelu1, _silu1
from cfr_atlas.ops.norm import _rms_norm_kernel
from cfr_atlas.ops.rope import _rotate_kernel
from cfr_atlas.quant import QuantWeight

_EXP = np.uint32(0x7F800000)


class DecodeLayer(NamedTuple):
    """One layer of a dense decoder as its family describes it to the step. Norm weights are
    (D,) float32 as the family's own pieces use them; None where the family has no such norm.
    `qkv` and `gate_up` are `parts` of the fused weights."""

    attn_norm: np.ndarray
    qkv: list  # [(QuantWeight, its columns of the Q|K|V row)]
    bias: np.ndarray | None  # Q|K|V biases (qwen2)
    q_norm: np.ndarray | None  # per-head QK-norm weights (hd,), both or neither (Gemma 3)
    k_norm: np.ndarray | None
    rope: object  # key of the layer's tables in forward_layers' rope (None: rope is the tables)
    options: dict  # the layer's attention options (the family's attention_options)
    wo: QuantWeight
    post_attn_norm: np.ndarray | None
    ffn_norm: np.ndarray
    gate_up: list  # [(QuantWeight, its columns of the gate|up row)]
    gelu: bool  # GeGLU (tanh GELU), else SwiGLU (SiLU)
    down: QuantWeight
    post_ffn_norm: np.ndarray | None


def parts(w) -> list[tuple[QuantWeight, slice]]:
    """A fused weight, or the list of weights whose outputs concatenate (formats that differ),
    as (weight, its columns of the concatenated row): a row's columns are contiguous, so each
    weight writes its slice in place."""
    out, a = [], 0
    for wi in (w if isinstance(w, list) else [w]):
        out.append((wi, slice(a, a + wi.shape[0])))
        a += wi.shape[0]
    return out


@njit(cache=True, nogil=True)
def residual(x, y, post, has_post, eps, tmp):
    """x += y in float32, in place (the residual add `x + y`); with has_post, x += rms_norm(y,
    post) instead (ops.norm's kernel into tmp), as Gemma 3's post-norms. (1, D) rows."""
    if has_post:
        _rms_norm_kernel(y, post, eps, tmp)
        y = tmp
    xf, yf = x.ravel(), y.ravel()
    for i in range(xf.size):
        xf[i] = xf[i] + yf[i]


@njit(cache=True, nogil=True)
def residual_norm(x, y, post, has_post, weight, eps, tmp, h):
    """`residual`, then h = rms_norm(x, weight) by ops.norm's kernel."""
    residual(x, y, post, has_post, eps, tmp)
    _rms_norm_kernel(x, weight, eps, h)


@njit(cache=True, nogil=True)
def _finite(a) -> bool:
    """No inf or NaN in float32 `a` (an integer OR-reduction over the exponent bits)."""
    bits = a.ravel().view(np.uint32)
    bad = np.uint32(0)
    for i in range(bits.size):
        bad |= np.uint32((bits[i] & _EXP) == _EXP)
    return bad == 0


@njit(cache=True, nogil=True)
def qkv_rows(qkv, bias, has_bias, q_norm, k_norm, has_norm, eps, cos, sin, neox, fmt,
             q_in, k_in, q, k, v, k_st, v_st) -> bool:
    """The fused Q|K|V row (1, nq + 2 nkv) -> q (1, n_heads, hd) and k (1, n_kv, hd) rotated
    (ops.rope's kernel; q_in, k_in: scratch for the unrotated rows), v (1, n_kv, hd), and k, v
    rounded to the storage format into k_st, v_st. The bias, when has_bias, is added first in
    float32, as `qkv += bias`; with has_norm each head of q and k is RMS-normed (ops.norm's
    kernel, one row per head) before the rotation. True when k and v are storable
    (`Atlas.stored_rows` would accept them) and q is finite (`Atlas.write_attend` would); else
    False, and the caller takes `Session.store_attend`, which raises."""
    row = qkv.ravel()
    qf, kf, vf = q_in.ravel(), k_in.ravel(), v.ravel()
    n_q, n_kv = qf.size, kf.size
    for i in range(n_q):
        qf[i] = row[i] + bias[i] if has_bias else row[i]
    for i in range(n_kv):
        kf[i] = row[n_q + i] + bias[n_q + i] if has_bias else row[n_q + i]
    for i in range(n_kv):
        j = n_q + n_kv + i
        vf[i] = row[j] + bias[j] if has_bias else row[j]
    if has_norm:
        hd = q_in.shape[2]
        q2, k2 = q_in.reshape(n_q // hd, hd), k_in.reshape(n_kv // hd, hd)
        _rms_norm_kernel(q2, q_norm, eps, q2)
        _rms_norm_kernel(k2, k_norm, eps, k2)
    _rotate_kernel(q_in, cos, sin, neox, 1.0, q)
    _rotate_kernel(k_in, cos, sin, neox, 1.0, k)
    ok_k = round_checked(k, fmt, k_st)
    ok_v = round_checked(v, fmt, v_st)
    return ok_k and ok_v and _finite(q)


@njit(cache=True, nogil=True)
def gated_rows(gu, gelu, a):
    """gu (1, 2 hid) the fused gate|up row -> a (1, hid) = act(gate) * up, elementwise as
    ops.activations' swiglu (act = silu) or geglu (gelu) kernel computes it."""
    hid = a.shape[1]
    for j in range(hid):
        g = _gelu1(gu[0, j]) if gelu else _silu1(gu[0, j])
        a[0, j] = g * gu[0, hid + j]


class _Buffers:
    """One thread's rows for one step (a model may serve sequences from several threads)."""

    def __init__(self, c, hidden: int):
        f32 = np.float32
        nq, nkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.x, self.h = np.empty((1, c.dim), f32), np.empty((1, c.dim), f32)
        self.o, self.d = np.empty((1, c.dim), f32), np.empty((1, c.dim), f32)
        self.tmp = np.empty((1, c.dim), f32)
        self.qkv = np.empty((1, nq + 2 * nkv), f32)
        self.q_in, self.q = (np.empty((1, c.n_heads, c.head_dim), f32) for _ in range(2))
        self.k_in, self.k, self.v = (np.empty((1, c.n_kv_heads, c.head_dim), f32)
                                     for _ in range(3))
        self.q4 = self.q.reshape(1, c.n_kv_heads, c.group, c.head_dim)  # a view of q
        self.attn = np.empty((1, c.n_kv_heads, c.group, c.head_dim), f32)
        self.gu, self.a = np.empty((1, 2 * hidden), f32), np.empty((1, hidden), f32)
        self.stored: dict = {}  # storage array dtype -> (k_st, v_st)

    def stored_rows(self, dtype: np.dtype, shape) -> tuple[np.ndarray, np.ndarray]:
        rows = self.stored.get(dtype)
        if rows is None:
            rows = self.stored[dtype] = (np.empty(shape, dtype), np.empty(shape, dtype))
        return rows


_NONE = np.zeros(1, dtype=np.float32)  # an absent bias or norm, never read


class DecodeStep:
    """One token through every layer of a dense decoder (see the module docstring); called by
    `forward_layers` with the embedded row and the RoPE tables of its position."""

    def __init__(self, config, layers: list[DecodeLayer]):
        self.config, self.layers = config, layers
        self.eps = np.float32(config.norm_eps)  # as ops.norm's rms_norm passes it
        self.neox = config.rope_mode == "neox"
        self.hidden = sum(w.shape[0] for w, _ in layers[0].gate_up) // 2
        if any(sum(w.shape[0] for w, _ in lay.gate_up) != 2 * self.hidden for lay in layers):
            raise ValueError("the decode step needs one hidden size for every layer")
        self._local = threading.local()

    def _buffers(self) -> _Buffers:
        b = getattr(self._local, "buffers", None)
        if b is None:
            b = self._local.buffers = _Buffers(self.config, self.hidden)
        return b

    def __call__(self, session, pos0: int, x0: np.ndarray, rope) -> np.ndarray:
        """x0 (1, dim): the token's embedding at position pos0, rope its tables -> the last
        layer's output (1, dim), a new array; the session holds the token's K/V rows after."""
        b, eps = self._buffers(), self.eps
        dtype = session.atlas.config.dtype
        fmt = format_of(dtype)
        k_st, v_st = b.stored_rows(dtype.array_dtype, b.k.shape)
        x, h, d, tmp = b.x, b.h, b.d, b.tmp
        x[...] = x0
        post = None  # the previous layer's post-FFN norm
        for i, lay in enumerate(self.layers):
            if i:
                residual_norm(x, d, _NONE if post is None else post, post is not None,
                              lay.attn_norm, eps, tmp, h)
            else:
                _rms_norm_kernel(x, lay.attn_norm, eps, h)
            for w, cols in lay.qkv:
                w.product(h, b.qkv[:, cols])
            cos, sin = rope if lay.rope is None else rope[lay.rope]
            has_norm = lay.q_norm is not None
            if qkv_rows(b.qkv, _NONE if lay.bias is None else lay.bias, lay.bias is not None,
                        lay.q_norm if has_norm else _NONE, lay.k_norm if has_norm else _NONE,
                        has_norm, eps, cos, sin, self.neox, fmt, b.q_in, b.k_in, b.q, b.k, b.v,
                        k_st, v_st):
                attn = session.decode_attend(i, pos0, x, k_st, v_st, b.q4, b.attn, **lay.options)
            else:  # not storable, or q not finite: the general call raises what it raises
                attn = session.store_attend(i, pos0, x, b.k, b.v, b.q4, **lay.options)
            lay.wo.product(attn.reshape(1, -1), b.o)
            pa = lay.post_attn_norm
            residual_norm(x, b.o, _NONE if pa is None else pa, pa is not None, lay.ffn_norm,
                          eps, tmp, h)
            for w, cols in lay.gate_up:
                w.product(h, b.gu[:, cols])
            gated_rows(b.gu, lay.gelu, b.a)
            lay.down.product(b.a, d)
            post = lay.post_ffn_norm
        residual(x, d, _NONE if post is None else post, post is not None, eps, tmp)
        return x.copy()
