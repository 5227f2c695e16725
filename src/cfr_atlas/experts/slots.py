"""Slot layouts: where one expert's repacked tile arrays sit in a row of the pool, and how an
expert is written there.

A `Layout` is measured once per layer format signature on expert 0 (every expert of a layer
has one shape and format): per matrix (gate|up, down) the offset, dtype and shape of each tile
array, 64-byte aligned, and a template QuantWeight (name aside, what every expert's weight over
its slot views looks like). `write(tile_views(row, layout), ...)` fills a slot row with one
expert and returns its (gate_up, down) weights over the row's views. A matrix whose
(arithmetic, format) has a one-pass kernel (repack.KERNELS) is filled straight from the
mapped GGUF bytes; any other through its codec's repack and a copy. The one-pass fill is used
only if it wrote, for expert 0, the very bytes the codec's repack gives (checked here at build
time; a mismatch is a warning and the codec path).
Not here: which slot holds what (store.py), reading ahead (prefetch.py).
"""

from __future__ import annotations

import warnings
from typing import NamedTuple

import numpy as np

from cfr_atlas.experts.repack import KERNELS
from cfr_atlas.experts.source import ExpertSource
from cfr_atlas.quant import QuantWeight
from cfr_atlas.quant.weight import ARITHMETIC

ALIGN = 64  # bytes; every tile array in a slot starts on a cache line


class Part(NamedTuple):
    offset: int
    dtype: np.dtype
    shape: tuple


class Layout(NamedTuple):
    """Where one expert's tile arrays sit in a slot row, per matrix (gate|up, down)."""

    parts: tuple  # per matrix: tuple of Part or a plain value (a non-array tile field)
    nbytes: int
    templates: tuple = ()  # per matrix: expert 0's QuantWeight (qtype, shape, codec, tiles type)
    one_pass: tuple = ()  # per matrix: filled by repack.KERNELS straight from the file bytes


def layouts(source: ExpertSource) -> list[Layout]:
    """Per layer, the slot layout of its experts; layers with equal formats share one."""
    memo, out = {}, []
    for layer, mats in enumerate(source.layers):
        sig = tuple((m.ggml_type, m.rows, m.cols) for m in mats)
        if sig not in memo:
            memo[sig] = _measure(source, layer)
        out.append(memo[sig])
    return out


def _measure(source: ExpertSource, layer: int) -> Layout:
    weights = source.build(layer, 0)
    off, parts = 0, []
    for w in weights:
        mine = []
        for a in w.tiles:
            if not isinstance(a, np.ndarray):
                mine.append(a)
                continue
            mine.append(Part(off, a.dtype, a.shape))
            off += -(-a.nbytes // ALIGN) * ALIGN
        parts.append(tuple(mine))
    lay = Layout(tuple(parts), off, tuple(weights), (False,) * len(weights))
    fast = tuple(_one_pass_fits(w, source.arithmetic) for w in weights)
    if any(fast):
        trial = Layout(lay.parts, lay.nbytes, lay.templates, fast)
        row = np.full(off, 0xA5, dtype=np.uint8)  # garbage: padding must be written too
        got = write(tile_views(row, trial), source, layer, 0, trial)
        if all(_same(a, b) for a, b in zip(got, weights, strict=True)):
            return trial
        warnings.warn(f"layer {layer}: the one-pass expert repack differs from the codec's "
                      "(has the tile layout changed?); loading experts through the codec",
                      RuntimeWarning, stacklevel=2)
    return lay


def _one_pass_fits(w: QuantWeight, arithmetic: str) -> bool:
    kernel = KERNELS.get((arithmetic, w.qtype))
    return (kernel is not None and w.codec is ARITHMETIC[arithmetic][w.qtype]
            and kernel[0](w.tiles))


def _same(a: QuantWeight, b: QuantWeight) -> bool:
    return all(x.dtype == y.dtype and np.array_equal(x.view(np.uint8), y.view(np.uint8))
               for x, y in zip(a.tiles, b.tiles, strict=True) if isinstance(x, np.ndarray))


def tile_views(row: np.ndarray, layout: Layout) -> tuple:
    """Per matrix of `layout`, its tiles (the template's tiles type) over `row`'s arrays at
    the layout's parts: views, no copy."""
    out = []
    for template, parts in zip(layout.templates, layout.parts, strict=True):
        tiles = []
        for a, part in zip(template.tiles, parts, strict=True):
            if not isinstance(a, np.ndarray):
                tiles.append(a)
                continue
            n = int(np.prod(part.shape)) * part.dtype.itemsize
            tiles.append(row[part.offset:part.offset + n].view(part.dtype).reshape(part.shape))
        out.append(type(template.tiles)(*tiles))
    return tuple(out)


def write(tiles: tuple, source: ExpertSource, layer: int, e: int,
          layout: Layout) -> tuple[QuantWeight, QuantWeight]:
    """Expert e of `layer` into a slot whose `tile_views` for `layout` are `tiles` -> (gate_up,
    down) over them. Writes only the slot; called without the store's lock (the one-pass
    kernels release the GIL)."""
    name = f"blk.{layer}.expert{e}"
    out = [QuantWeight(f"{name}.{role}", t.qtype, t.shape, v, t.codec) for t, v, role
           in zip(layout.templates, tiles, ("gate_up", "down"), strict=True)]
    built = None
    with source.expert_bytes(layer, e) as raws:  # staged by the reader, or the mapped file
        for i, (w, mats) in enumerate(zip(out, (raws[:2], raws[2:]), strict=True)):
            if layout.one_pass[i]:
                KERNELS[source.arithmetic, w.qtype][1](
                    [a.reshape(-1).view(np.uint8) for a in mats], w.qtype, w.shape[1], w.tiles)
                continue
            built = built or source.build(layer, e, raws)
            for dst, src in zip(w.tiles, built[i].tiles, strict=True):
                if isinstance(dst, np.ndarray):
                    np.copyto(dst, src)
    return out[0], out[1]
