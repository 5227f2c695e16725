"""One batched forward step: its items and the row bookkeeping every family shares.

A `BatchItem` is one sequence's share of a step: its Session, the token ids it feeds (a prefill
chunk or one decode token) and which outputs it wants, with the same meaning as the arguments
of `forward_chunk`. The rows of all items are concatenated, item after item, for everything
that is row-independent (embedding, norms, matmuls, activations, RoPE tables); `Rows` tracks
which rows belong to which item while items that fail leave the pass.

This module holds no arithmetic and no family-specific code; `LlamaModel.forward_batch` is
the pass itself.
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
