"""The decode step: one token through a dense Llama-family layer stack in a few compiled calls
per layer.

`forward_layers` builds a layer from the family's pieces (`attention_inputs`, the session's
`store_attend`, `layer_output`), each made of checked public ops: about 280 Python calls a layer,
4-5 ms of a bundled-model token. For a single token, `DecodeStep` runs the same arithmetic on
preallocated buffers, layer by layer:

    add_rms_norm    x += d (the previous layer's output), h = rms_norm(x)   (layer 0: rms_norm)
    product         qkv = h Wqkv^T             (the weight's own kernel, `QuantWeight.product`)
    qkv_rows        + bias; q and k rotated; k, v rounded to the storage dtype and checked
    decode_attend   the session's regenerator copy, then the hot-cache append and fold
    product         o = attn Wo^T
    add_rms_norm    x += o, h = rms_norm(x)
    product         gu = h Wgu^T
    swiglu_rows     a = silu(gu[:hid]) * gu[hid:]
    product         d = a Wdown^T

Each kernel calls the kernels of the ops it stands for (ops/norm.py's RMS norm, ops/rope.py's
rotation, ops/activations.py's silu, atlas/storage.py's rounding and check) on the same values,
and the residual adds are the same float32 adds, so every bit is that of `forward_layers`: the
tests hold the two to np.array_equal over weight formats, both arithmetics, every storage dtype,
budgets, regenerators and page boundaries. What the compiled walk does not cover takes the
general calls inside the layer: rows that are not storable, or a query that is not finite, go
through `Session.store_attend` (which raises what it raises); a new page, a miss or a budget
that evicts go through `Atlas.write_attend` (`Session.decode_attend`).

`DecodeStep.applies` says which models it serves: dense Llama-family models without QK-norm
(Q|K|V and gate|up fused into one weight each, or lists of weights when their formats differ,
each writing its columns of the row). MoE models, QK-norm, Gemma 3 and DeepSeek2 take
`forward_layers` for every token.
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

from cfr_atlas.atlas.storage import format_of, round_checked
from cfr_atlas.models.moe import DenseFfn
from cfr_atlas.ops.activations import _silu1
from cfr_atlas.ops.norm import _rms_norm_kernel
from cfr_atlas.ops.rope import _rotate_kernel
from cfr_atlas.quant import QuantWeight

_EXP = np.uint32(0x7F800000)


@njit(cache=True, nogil=True)
def add_rms_norm(x, y, weight, eps, h):
    """x += y in float32, in place (the residual add `x + y`), then h = rms_norm(x, weight)
    by ops.norm's kernel. x, y, h: (1, D) float32."""
    xf, yf = x.ravel(), y.ravel()
    for i in range(xf.size):
        xf[i] = xf[i] + yf[i]
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
def qkv_rows(qkv, bias, has_bias, cos, sin, neox, fmt, q_in, k_in, q, k, v, k_st, v_st) -> bool:
    """The fused Q|K|V row (1, nq + 2 nkv) -> q (1, n_heads, hd) and k (1, n_kv, hd) rotated
    (ops.rope's kernel; q_in, k_in: scratch for the unrotated rows), v (1, n_kv, hd), and k, v
    rounded to the storage format into k_st, v_st. The bias, when has_bias, is added first in
    float32, as `qkv += bias`. True when k and v are storable (`Atlas.stored_rows` would accept
    them) and q is finite (`Atlas.write_attend` would); else False, and the caller takes
    `Session.store_attend`, which raises."""
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
    _rotate_kernel(q_in, cos, sin, neox, 1.0, q)
    _rotate_kernel(k_in, cos, sin, neox, 1.0, k)
    ok_k = round_checked(k, fmt, k_st)
    ok_v = round_checked(v, fmt, v_st)
    return ok_k and ok_v and _finite(q)


@njit(cache=True, nogil=True)
def swiglu_rows(gu, a):
    """gu (1, 2 hid) the fused gate|up row -> a (1, hid) = silu(gate) * up, elementwise as
    ops.activations' swiglu kernel computes it."""
    hid = a.shape[1]
    for j in range(hid):
        a[0, j] = _silu1(gu[0, j]) * gu[0, hid + j]


class _Buffers:
    """One thread's rows for one step (a model may serve sequences from several threads)."""

    def __init__(self, c, hidden: int):
        f32 = np.float32
        nq, nkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.x, self.h = np.empty((1, c.dim), f32), np.empty((1, c.dim), f32)
        self.o, self.d = np.empty((1, c.dim), f32), np.empty((1, c.dim), f32)
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


def _parts(w) -> list[tuple[QuantWeight, slice]]:
    """A fused weight, or the list of weights whose outputs concatenate (formats that differ),
    as (weight, its columns of the concatenated row)."""
    out, a = [], 0
    for wi in (w if isinstance(w, list) else [w]):
        out.append((wi, slice(a, a + wi.shape[0])))
        a += wi.shape[0]
    return out


class DecodeStep:
    """One token through every layer of a dense Llama-family model (see the module docstring);
    called by `forward_layers` with the embedded row and the RoPE tables of its position."""

    def __init__(self, net):
        c = net.config
        self.config, self.layers = c, net.weights.layers
        self.eps = np.float32(c.norm_eps)  # as ops.norm's rms_norm passes it
        self.neox = c.rope_mode == "neox"
        self.hidden = self.layers[0].ffn.hidden_dim
        no_bias = np.zeros(1, dtype=np.float32)
        self.bias = [(no_bias, False) if lay.bqkv is None else (lay.bqkv, True)
                     for lay in self.layers]
        # a row's columns are contiguous: each weight of a list writes its slice in place
        self.qkv = [_parts(lay.wqkv) for lay in self.layers]
        self.gu = [_parts(lay.ffn.w_gate_up) for lay in self.layers]
        self._local = threading.local()

    @staticmethod
    def applies(net) -> bool:
        """Dense FFNs of one hidden size, no QK-norm."""
        c = net.config
        layers = net.weights.layers
        return (not c.n_experts and c.qk_norm is None and bool(layers)
                and all(isinstance(lay.ffn, DenseFfn)
                        and lay.ffn.hidden_dim == layers[0].ffn.hidden_dim for lay in layers))

    def _buffers(self) -> _Buffers:
        b = getattr(self._local, "buffers", None)
        if b is None:
            b = self._local.buffers = _Buffers(self.config, self.hidden)
        return b

    def __call__(self, session, pos0: int, x0: np.ndarray, rope) -> np.ndarray:
        """x0 (1, dim): the token's embedding at position pos0, rope its (cos, sin) -> the last
        layer's output (1, dim), a new array; the session holds the token's K/V rows after."""
        b, eps = self._buffers(), self.eps
        cos, sin = rope
        dtype = session.atlas.config.dtype
        fmt = format_of(dtype)
        k_st, v_st = b.stored_rows(dtype.array_dtype, b.k.shape)
        x, h, d = b.x, b.h, b.d
        x[...] = x0
        for i, lay in enumerate(self.layers):
            if i:
                add_rms_norm(x, d, lay.attn_norm, eps, h)
            else:
                _rms_norm_kernel(x, lay.attn_norm, eps, h)
            for w, cols in self.qkv[i]:
                w.product(h, b.qkv[:, cols])
            bias, has_bias = self.bias[i]
            if qkv_rows(b.qkv, bias, has_bias, cos, sin, self.neox, fmt, b.q_in, b.k_in, b.q,
                        b.k, b.v, k_st, v_st):
                attn = session.decode_attend(i, pos0, x, k_st, v_st, b.q4, b.attn)
            else:  # not storable, or q not finite: the general call raises what it raises
                attn = session.store_attend(i, pos0, x, b.k, b.v, b.q4)
            w = lay.wo
            w.product(attn.reshape(1, -1), b.o)
            add_rms_norm(x, b.o, lay.ffn_norm, eps, h)
            for w, cols in self.gu[i]:
                w.product(h, b.gu[:, cols])
            swiglu_rows(b.gu, b.a)
            w = lay.ffn.w_down
            w.product(b.a, d)
        return x + d
