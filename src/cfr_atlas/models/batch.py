"""One batched forward step: its items and the row bookkeeping every family shares.

A `BatchItem` is one sequence's share of a step: its Session, the token ids it feeds (a prefill
chunk or one decode token) and which outputs it wants, with the same meaning as the arguments
of `forward_chunk`. The rows of all items are concatenated, item after item, for everything
that is row-independent (embedding, norms, matmuls, activations, RoPE tables); `Rows` tracks
which rows belong to which item while items that fail leave the pass.

`batched_forward` is the pass itself, for every family that gives it the pieces of a layer
(see its docstring); this module holds no arithmetic and no family-specific code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import ConfigError


@dataclass(frozen=True, eq=False)
class BatchItem:
    """One sequence's share of a batched step (the arguments of `forward_chunk`)."""

    session: object  # a models.session.Session: its K/V state, position and budget
    ids: np.ndarray  # (T,) int64, T >= 1, fed at positions session.n_tokens ...
    all_logits: bool = False  # logits of every row, else of the last row only
    output: bool = True  # False: no output head (a prefill chunk nobody reads): result None
    hidden: bool = False  # the final normalized hidden states instead of logits


def check_item(item: BatchItem, vocab_size: int, sessions: set[int]) -> None:
    """Refuse an item before the step (so one bad item cannot fail the shared kernels); a
    session may feed one item per step (`sessions`: ids of those seen so far, updated)."""
    if id(item.session) in sessions:
        raise ConfigError("session", "appears twice in one batched step (one item per "
                                     "sequence per step)")
    ids = item.ids
    if not isinstance(ids, np.ndarray) or ids.ndim != 1 or ids.size == 0 \
            or ids.dtype.kind not in "iu":
        raise ConfigError("ids", f"a batch item needs a non-empty 1-D integer array, got "
                                 f"{getattr(ids, 'dtype', type(ids).__name__)} "
                                 f"{getattr(ids, 'shape', None)}")
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise ConfigError("ids", f"token ids must be in [0, {vocab_size}), got "
                                 f"[{ids.min()}, {ids.max()}]")
    sessions.add(id(item.session))


class Rows:
    """Which rows of the concatenated activations belong to which live item.

    `live` lists item indices in row order; `spans[n]` is the slice of item `live[n]`.
    Dropping items keeps the others' rows in order, so a row's arithmetic never changes.
    """

    def __init__(self, items: list[BatchItem], live: list[int]):
        self.live = live
        self.pos0 = {j: items[j].session.n_tokens for j in live}
        self._lengths = {j: len(items[j].ids) for j in live}
        self.spans = self._spans()

    def _spans(self) -> list[slice]:
        out, a = [], 0
        for j in self.live:
            out.append(slice(a, a + self._lengths[j]))
            a += self._lengths[j]
        return out

    def positions(self) -> np.ndarray:
        """(rows,) int64: each row's position in its own sequence."""
        return np.concatenate([np.arange(self.pos0[j], self.pos0[j] + self._lengths[j],
                                         dtype=np.int64) for j in self.live])

    def drop(self, failed: list[int]) -> np.ndarray:
        """Remove `failed` items; returns the (old rows,) bool mask of the rows kept."""
        keep = np.ones(sum(self._lengths[j] for j in self.live), dtype=bool)
        for j, rows in zip(self.live, self.spans, strict=True):
            if j in failed:
                keep[rows] = False
        self.live = [j for j in self.live if j not in failed]
        self.spans = self._spans()
        return keep

    def output_rows(self, items: list[BatchItem]) -> list[tuple[int, np.ndarray]]:
        """(item, row indices) of every live item that wants an output: all rows or the last."""
        out = []
        for j, rows in zip(self.live, self.spans, strict=True):
            if items[j].output:
                first = rows.start if items[j].all_logits else rows.stop - 1
                out.append((j, np.arange(first, rows.stop)))
        return out


def one_by_one(net, items: list[BatchItem]) -> list:
    """`forward_batch` for a family without a concatenated pass yet: each item through its own
    `forward_chunk`, in order (exact by construction; the weights stream once per item). Per
    item the result, or the exception it raised (a bad item is refused before any work)."""
    results: list = [None] * len(items)
    seen: set[int] = set()
    for j, item in enumerate(items):
        try:
            check_item(item, net.config.vocab_size, seen)
            results[j] = net.forward_chunk(item.session, item.ids, all_logits=item.all_logits,
                                           hidden=item.hidden, output=item.output)
        except Exception as exc:
            results[j] = exc
    return results


def take_rows(tables, keep: np.ndarray):
    """RoPE tables (arrays, or tuples / dicts of them, one row per activation row) at `keep`."""
    if isinstance(tables, dict):
        return {key: take_rows(value, keep) for key, value in tables.items()}
    if isinstance(tables, tuple):
        return tuple(take_rows(value, keep) for value in tables)
    return tables[keep]


def batched_forward(net, items: list[BatchItem]) -> list:
    """Several sequences' chunks in one pass -> per item exactly what `net.forward_chunk` of
    that item alone returns (bitwise), or the exception that item raised.

    Every weight matmul, norm, activation and the RoPE tables run once over the rows of all
    items concatenated (each op is row-independent: a row's bits never depend on its
    neighbours or their number), so the weights stream once per step. Positions, the K/V
    store and attention run per item on its own session (pages, budget, regenerator).

    The family gives the pieces its `forward_chunk` is made of: `embed(ids)`, `rope(positions)`
    (tables with one row per activation row), `attention_inputs(layer, x, rope)` -> q (T, n_kv,
    group, hd), k, v (T, n_kv, hd), `attention_options(layer)` (the Atlas's score options),
    `layer_output(layer, x, attn)` -> the next layer's input from x and attn (T, n_heads * hd),
    `final_norm(x)`, `head(h)` -> logits, and `begin_step()`.

    Errors stay with their item: an item with bad ids is refused before the pass; an item
    whose store, attention or advance raises leaves the pass at once (its rows are dropped
    from the activations), so the other items and their sessions go on exactly as if it
    had never been in the batch. The failed item's session is left mid-chunk (n_tokens not
    advanced, some layers' rows stored): close it, as after a failed `forward_chunk`. Only
    an error in a shared kernel (a bug, or out of memory) propagates: then every item's
    session is mid-chunk. A batch of one is `forward_chunk` itself (whatever makes one
    sequence fast serves it; the tests hold both paths to the same bits). A step of single
    tokens (decode) goes through `net.decode_step.run` when the family has one and the
    sessions share a storage dtype: the same arithmetic in a few compiled calls per layer
    (models/decode.py), errors kept with their item the same way.
    """
    results: list = [None] * len(items)
    live, seen = [], set()
    for j, item in enumerate(items):
        try:
            check_item(item, net.config.vocab_size, seen)
            live.append(j)
        except Exception as exc:
            results[j] = exc
    if len(live) == 1:
        item = items[live[0]]
        try:
            results[live[0]] = net.forward_chunk(item.session, item.ids,
                                                 all_logits=item.all_logits,
                                                 hidden=item.hidden, output=item.output)
        except Exception as exc:
            results[live[0]] = exc
        return results
    if not live:
        return results
    rows = Rows(items, live)
    net.begin_step()
    x = net.embed(np.concatenate([items[j].ids for j in live]))
    rope = net.rope(rows.positions())
    sessions = [items[j].session for j in live]
    if net.decode_step is not None and all(len(items[j].ids) == 1 for j in live) \
            and net.decode_step.serves(sessions):  # one token each: the decode step's rows
        x, failed = net.decode_step.run(sessions, [rows.pos0[j] for j in live], x, rope)
        for k, exc in failed.items():
            results[live[k]] = exc
        rows.drop([live[k] for k in failed])
        if not rows.live:
            return results
        return _advance_and_output(net, items, rows, x, results)
    for i in range(net.config.n_layers):
        q, k, v = net.attention_inputs(i, x, rope)
        options = net.attention_options(i)
        attn = np.empty((x.shape[0], q.shape[1] * q.shape[2] * q.shape[3]), dtype=np.float32)
        failed = []
        for j, r in zip(rows.live, rows.spans, strict=True):  # per sequence: own K/V
            try:
                attn[r] = items[j].session.store_attend(
                    i, rows.pos0[j], x[r], k[r], v[r], q[r], **options).reshape(len(x[r]), -1)
            except Exception as exc:
                results[j] = exc
                failed.append(j)
        if failed:
            keep = rows.drop(failed)
            x, attn, rope = x[keep], attn[keep], take_rows(rope, keep)
            if not rows.live:
                return results
        x = net.layer_output(i, x, attn)
    return _advance_and_output(net, items, rows, x, results)


def _advance_and_output(net, items, rows: Rows, x: np.ndarray, results: list) -> list:
    """After the layers: count each live item's tokens, then its outputs."""
    for j in list(rows.live):
        try:
            items[j].session.advance(items[j].ids)
        except Exception as exc:
            results[j] = exc
    return _batch_outputs(net, items, rows, x, results)


def _batch_outputs(net, items, rows: Rows, x: np.ndarray, results: list) -> list:
    """Final norm and head over the wanted rows of every item still without a result."""
    wanted = [(j, r) for j, r in rows.output_rows(items) if results[j] is None]
    if not wanted:
        return results
    h = net.final_norm(x[np.concatenate([r for _, r in wanted])])
    logit_rows = np.concatenate([np.full(len(r), not items[j].hidden) for j, r in wanted])
    logits = net.head(h[logit_rows]) if logit_rows.any() else None
    a = b = 0  # a: row in h, b: row in logits
    for j, r in wanted:
        if items[j].hidden:
            results[j] = h[a:a + len(r)].copy()  # its own array: holds no other's rows
        else:
            results[j] = logits[b:b + len(r)].copy()
            b += len(r)
        a += len(r)
    return results


def forward_layers(net, session, ids: np.ndarray, all_logits: bool, hidden: bool,
                   output: bool) -> np.ndarray | None:
    """One sequence's chunk through the family's pieces (see `batched_forward`): what every
    family's `forward_chunk` is, so the batched pass and the single one are made of the same
    calls on the same rows. A single token goes through `net.decode_step` when the family has
    one (models/decode.py: the same arithmetic in a few compiled calls per layer), as a
    batched step of single tokens does."""
    T, pos0 = ids.shape[0], session.n_tokens
    net.begin_step()
    x = net.embed(ids)
    rope = net.rope(np.arange(pos0, pos0 + T, dtype=np.int64))
    if T == 1 and net.decode_step is not None:  # the same arithmetic, few compiled calls
        x = net.decode_step(session, pos0, x, rope)
    else:
        for i in range(net.config.n_layers):
            q, k, v = net.attention_inputs(i, x, rope)
            attn = session.store_attend(i, pos0, x, k, v, q, **net.attention_options(i))
            x = net.layer_output(i, x, attn.reshape(T, -1))
    session.advance(ids)
    if not output:
        return None
    x = net.final_norm(x if all_logits else x[-1:])
    return x if hidden else net.head(x)
