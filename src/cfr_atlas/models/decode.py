"""The decode step: one token through a dense decoder's layers in a few compiled calls per
layer, for the Llama family (dense, no QK-norm) and Gemma 3.

`forward_layers` builds a layer from the family's pieces (`attention_inputs`, the session's
`store_attend`, `layer_output`), each made of checked public ops: about 240 Python calls a layer,
4 ms of a bundled-model token. For single tokens (one sequence, or a decode batch of several),
`DecodeStep` runs the same arithmetic on preallocated buffers in nine steps a layer (10-14
compiled calls: an int8 product quantizes, then multiplies; the attention appends, then
folds), from a description the family gives (`DecodeLayer`):

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

from cfr_atlas.atlas.batch_walk import HotWalks
from cfr_atlas.atlas.storage import FORMATS, format_of, round_checked, storable
from cfr_atlas.errors import ModelFormatError
from cfr_atlas.models.batch import take_rows
from cfr_atlas.ops.activations import _gated_halves_kernel
from cfr_atlas.ops.norm import _rms_norm_kernel
from cfr_atlas.ops.rope import _rotate_kernel
from cfr_atlas.quant import QuantWeight


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
def qkv_rows(qkv, bias, has_bias, q_norm, k_norm, has_norm, eps, cos, sin, neox, fmt,
             q_in, k_in, q, k, v, k_st, v_st) -> bool:
    """Fused Q|K|V rows (n, nq + 2 nkv), one token each -> q (n, n_heads, hd) and k (n, n_kv,
    hd) rotated (ops.rope's kernel, row t by cos[t], sin[t]; q_in, k_in: scratch for the
    unrotated rows), v (n, n_kv, hd), and k, v rounded to the storage format into k_st, v_st.
    The bias, when has_bias, is added first in float32, as `qkv += bias`; with has_norm each
    head of q and k is RMS-normed (ops.norm's kernel, one row per head) before the rotation.
    True when k and v are storable (`Atlas.stored_rows` would accept them) and q is finite
    (`Atlas.write_attend` would); else False, and the caller takes `Session.store_attend`,
    which raises for the rows at fault."""
    n = qkv.shape[0]
    n_q, n_kv = q_in.shape[1] * q_in.shape[2], k_in.shape[1] * k_in.shape[2]
    qf, kf, vf = q_in.reshape(n, n_q), k_in.reshape(n, n_kv), v.reshape(n, n_kv)
    for t in range(n):
        for i in range(n_q):
            qf[t, i] = qkv[t, i] + bias[i] if has_bias else qkv[t, i]
        for i in range(n_kv):
            j = n_q + i
            kf[t, i] = qkv[t, j] + bias[j] if has_bias else qkv[t, j]
        for i in range(n_kv):
            j = n_q + n_kv + i
            vf[t, i] = qkv[t, j] + bias[j] if has_bias else qkv[t, j]
    if has_norm:
        hd = q_in.shape[2]
        q2, k2 = q_in.reshape(n * n_q // hd, hd), k_in.reshape(n * n_kv // hd, hd)
        _rms_norm_kernel(q2, q_norm, eps, q2)
        _rms_norm_kernel(k2, k_norm, eps, k2)
    _rotate_kernel(q_in, cos, sin, neox, 1.0, q)
    _rotate_kernel(k_in, cos, sin, neox, 1.0, k)
    ok_k = round_checked(k, fmt, k_st)
    ok_v = round_checked(v, fmt, v_st)
    return ok_k and ok_v and storable(q, q, _F32)  # float32 "storage": q finite


gated_rows = _gated_halves_kernel  # gu (n, 2 hid) [gate | up] -> a (n, hid): ops' gated_halves


class _Buffers:
    """One thread's rows for a step of n tokens (a model may serve sequences from several
    threads)."""

    def __init__(self, c, hidden: int, n: int):
        f32 = np.float32
        nq, nkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        self.x, self.h = np.empty((n, c.dim), f32), np.empty((n, c.dim), f32)
        self.o, self.d = np.empty((n, c.dim), f32), np.empty((n, c.dim), f32)
        self.tmp = np.empty((n, c.dim), f32)
        self.qkv = np.empty((n, nq + 2 * nkv), f32)
        self.q_in, self.q = (np.empty((n, c.n_heads, c.head_dim), f32) for _ in range(2))
        self.k_in, self.k, self.v = (np.empty((n, c.n_kv_heads, c.head_dim), f32)
                                     for _ in range(3))
        self.q4 = self.q.reshape(n, c.n_kv_heads, c.group, c.head_dim)  # a view of q
        self.attn = np.empty((n, c.n_kv_heads, c.group, c.head_dim), f32)
        self.gu, self.a = np.empty((n, 2 * hidden), f32), np.empty((n, hidden), f32)
        self.stored: dict = {}  # storage array dtype -> (k_st, v_st)

    def stored_rows(self, dtype: np.dtype, shape) -> tuple[np.ndarray, np.ndarray]:
        rows = self.stored.get(dtype)
        if rows is None:
            rows = self.stored[dtype] = (np.empty(shape, dtype), np.empty(shape, dtype))
        return rows


def _products(ws: list, h: np.ndarray, out: np.ndarray) -> None:
    """out = h W^T for `parts` ws: one weight writes out itself; several write their columns
    (in place for one row, whose columns are contiguous; through a row block otherwise)."""
    if len(ws) == 1:
        ws[0][0].product(h, out)
        return
    for w, cols in ws:
        if out.shape[0] == 1:
            w.product(h, out[:, cols])
        else:
            out[:, cols] = w.product(h, np.empty((out.shape[0], w.shape[0]), np.float32))


def _walk_rows(walks, sessions: list, live: list) -> tuple:
    """(the walks' row indices: walks.member itself while every sequence is live, [(row,
    sequence) of member rows whose regenerator keeps a copy of the rows]) for the step's live
    sequences; (None, None) without walks."""
    if walks is None:
        return None, None
    members = walks.member if len(live) == len(sessions) else walks.member[live]
    return members, [(r, j) for r, j in enumerate(live)
                     if members[r] >= 0 and sessions[j].records_rows()]


_NONE = np.zeros(1, dtype=np.float32)  # an absent bias or norm, never read
_F32 = FORMATS[0]


class DecodeStep:
    """One token through every layer of a dense decoder (see the module docstring); called by
    `forward_layers` with the embedded row and the RoPE tables of its position."""

    def __init__(self, config, layers: list[DecodeLayer]):
        self.config, self.layers = config, layers
        self.eps = np.float32(config.norm_eps)  # as ops.norm's rms_norm passes it
        self.neox = config.rope_mode == "neox"
        self.hidden = sum(w.shape[0] for w, _ in layers[0].gate_up) // 2
        if any(sum(w.shape[0] for w, _ in lay.gate_up) != 2 * self.hidden for lay in layers):
            raise ModelFormatError("the decode step needs one FFN hidden size for every layer")
        self._local = threading.local()

    def _buffers(self, n: int) -> _Buffers:
        sets = getattr(self._local, "buffers", None)
        if sets is None:
            sets = self._local.buffers = {}
        b = sets.get(n)
        if b is None:
            b = sets[n] = _Buffers(self.config, self.hidden, n)
        return b

    def __call__(self, session, pos0: int, x0: np.ndarray, rope) -> np.ndarray:
        """x0 (1, dim): the token's embedding at position pos0, rope its tables -> the last
        layer's output (1, dim), a new array; the session holds the token's K/V rows after.
        An error of the session's attention is raised."""
        x, failed = self.run([session], [pos0], x0, rope)
        if failed:
            raise failed[0]
        return x

    @staticmethod
    def serves(sessions: list) -> bool:
        """Whether one `run` may take these sessions: they share a storage dtype."""
        return len({s.atlas.config.dtype for s in sessions}) == 1

    def run(self, sessions: list, pos0s: list, x0: np.ndarray, rope) -> tuple[np.ndarray, dict]:
        """One token of each session (a `serves` list): x0 (n, dim) their embeddings in order,
        pos0s their positions, rope their tables (one row each) -> (the last layer's output
        of the sessions still in the step, in order, a new array; {index in sessions: the
        exception its attention raised}). A session whose attention raises leaves the step
        at that layer, its rows dropped (the others' rows do not change: every kernel is
        row-independent), its session mid-token, as `batch.batched_forward` leaves it."""
        walks = self._walks(sessions)
        if walks is None:
            return self._run(sessions, pos0s, x0, rope, None)
        walks.begin(len(self.layers))
        try:
            return self._run(sessions, pos0s, x0, rope, walks)
        finally:
            walks.end()  # every atlas's bookkeeping handed back, whatever happened

    # A sequence that is the only one of its step whose walks may be batched walks through
    # HotWalks too (its layer's arrays to one compiled call, no typed lists), not through
    # `Session.decode_attend`'s Python (~20 us a layer). False: the per-sequence call (the
    # tests' reference for the batched walks).
    walk_alone = True

    def _walks(self, sessions: list) -> HotWalks | None:
        """The batched walks of one step of these sessions, or None when none may join
        (`Session.batch_walk_atlas`), or one only and not `walk_alone`. Made per step and
        dropped after it, so nothing holds a sequence's arrays past its step."""
        atlases = [s.batch_walk_atlas() for s in sessions]
        first = next((a for a in atlases if a is not None), None)
        if first is None:
            return None
        atlases = [a if a is not None and HotWalks.fits(a, first.config) else None
                   for a in atlases]
        members = sum(a is not None for a in atlases)
        return HotWalks(atlases) if members >= 2 or self.walk_alone else None

    def _run(self, sessions: list, pos0s: list, x0: np.ndarray, rope,
             walks: HotWalks | None) -> tuple[np.ndarray, dict]:
        """`run`, with the sessions' all-hot walks batched by `walks` (None: each its own)."""
        live = list(range(len(sessions)))
        failed: dict = {}
        dtype = sessions[0].atlas.config.dtype
        fmt = format_of(dtype)
        b = self._buffers(len(live))
        b.x[...] = x0
        post = None  # the previous layer's post-FFN norm
        eps = self.eps
        starts = np.asarray(pos0s, dtype=np.int64)
        array_dtype = dtype.array_dtype
        # the walks' row indices (walks.member while every sequence is in the step) and the
        # member rows (row, sequence) whose regenerator keeps a copy of the rows: fixed until
        # a sequence leaves the step
        members, recorders = _walk_rows(walks, sessions, live)
        for i, lay in enumerate(self.layers):
            x, h, d, tmp = b.x, b.h, b.d, b.tmp
            if i:
                residual_norm(x, d, _NONE if post is None else post, post is not None,
                              lay.attn_norm, eps, tmp, h)
            else:
                _rms_norm_kernel(x, lay.attn_norm, eps, h)
            _products(lay.qkv, h, b.qkv)
            k_st, v_st = b.stored_rows(array_dtype, b.k.shape)
            cos, sin = rope if lay.rope is None else rope[lay.rope]
            has_norm = lay.q_norm is not None
            stored = qkv_rows(b.qkv, _NONE if lay.bias is None else lay.bias,
                              lay.bias is not None, lay.q_norm if has_norm else _NONE,
                              lay.k_norm if has_norm else _NONE, has_norm, eps, cos, sin,
                              self.neox, fmt, b.q_in, b.k_in, b.q, b.k, b.v, k_st, v_st)
            done = None
            gone = []
            if walks is not None and stored:  # the member rows' walks in one call
                walk_rows = members
                for r, j in recorders:  # the regenerators' copies first
                    try:
                        sessions[j].record_rows(i, pos0s[j], x[r:r + 1], k_st[r:r + 1],
                                                v_st[r:r + 1])
                    except Exception as exc:  # that sequence leaves the step, alone
                        failed[j] = exc
                        gone.append(r)
                if gone:
                    walk_rows = members.copy()
                    walk_rows[gone] = -1
                done = walks.run(i, walk_rows, starts, k_st, v_st, b.q4, b.attn, **lay.options)
            for r, j in ((r, j) for r, j in enumerate(live)
                         if done is None or not done[r]):  # per sequence: its own K/V
                if r in gone:
                    continue
                member = members is not None and members[r] >= 0
                if member:  # its own path sees the state its batched walks left
                    walks.flush(j)
                rows, out = slice(r, r + 1), b.attn[r:r + 1]
                try:
                    if stored:
                        a = sessions[j].decode_attend(i, pos0s[j], x[rows], k_st[rows],
                                                      v_st[rows], b.q4[rows], out,
                                                      recorded=member, **lay.options)
                    else:  # not storable, or q not finite: the general call raises its errors
                        a = sessions[j].store_attend(i, pos0s[j], x[rows], b.k[rows],
                                                     b.v[rows], b.q4[rows], **lay.options)
                    if a is not out:
                        out[...] = a.reshape(out.shape)
                except Exception as exc:
                    failed[j] = exc
                    gone.append(r)
                if member:
                    walks.resync(j)
            if gone:
                if len(gone) == len(live):
                    return x[:0].copy(), failed
                keep = np.ones(len(live), dtype=bool)
                keep[gone] = False
                live = [j for r, j in enumerate(live) if keep[r]]
                members, recorders = _walk_rows(walks, sessions, live)
                attn = b.attn[keep]
                kept = self._buffers(len(live))
                kept.x[...] = x[keep]
                kept.attn[...] = attn
                b, rope = kept, take_rows(rope, keep)
            x, h, d, tmp = b.x, b.h, b.d, b.tmp
            lay.wo.product(b.attn.reshape(len(live), -1), b.o)
            pa = lay.post_attn_norm
            residual_norm(x, b.o, _NONE if pa is None else pa, pa is not None, lay.ffn_norm,
                          eps, tmp, h)
            _products(lay.gate_up, h, b.gu)
            gated_rows(b.gu, lay.gelu, b.a)
            lay.down.product(b.a, d)
            post = lay.post_ffn_norm
        residual(b.x, b.d, _NONE if post is None else post, post is not None, eps, b.tmp)
        return b.x.copy(), failed
