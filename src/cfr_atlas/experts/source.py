"""`ExpertSource`: where routed-expert weights come from — the memory-mapped GGUF.

An expert's gate, up and down matrices are the e-th (rows, row_bytes) slab of the 3-D tensors
ffn_{gate,up,down}_exps (GGUF ne = [cols, rows, n_experts]): one contiguous byte range each.
`build` repacks one expert into QuantWeights (gate|up fused when they share a format, as the
dense FFN is); `check` refuses, at load, a format with no kernel (UnsupportedQuantError).
This module reads arrays it is handed; it does not open files or know tensor names.
"""

from __future__ import annotations

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cfr_atlas.errors import DimensionError, ModelFormatError, UnsupportedQuantError
from cfr_atlas.experts.reader import DirectReader, span_bound
from cfr_atlas.os_pages import resident_pages
from cfr_atlas.quant import QuantWeight
from cfr_atlas.quant.formats import qtype_from_gguf
from cfr_atlas.quant.weight import ARITHMETIC

WARM_ASKS = 32  # asks a tensor found wholly in the page cache is trusted to stay there


@dataclass(frozen=True)
class ExpertMatrix:
    """One 3-D expert tensor: `data` (n_experts, rows, row_bytes or cols) as mapped."""

    name: str
    ggml_type: object  # a gguf.GGMLQuantizationType
    data: np.ndarray
    rows: int
    cols: int
    offset: int = -1  # file offset of expert 0's bytes (-1: unknown, no read-ahead)

    def raw(self, e: int) -> np.ndarray:
        return self.data[e]

    def block_bytes(self, e: int) -> np.ndarray:
        """Expert e's bytes as one flat uint8 view of the mapped file (no copy)."""
        return self.data[e].reshape(-1).view(np.uint8)

    @cached_property
    def _base(self) -> int:
        return self.data.ctypes.data

    def address(self, e: int) -> int:
        """Where expert e's bytes are mapped (its first byte's address)."""
        return self._base + e * self.data.strides[0]

    def byte_range(self, e: int) -> tuple[int, int]:
        """(file offset, length) of expert e's bytes."""
        n = self.data[0].nbytes
        return self.offset + e * n, n


class ExpertSource:
    """Per layer (gate, up, down) ExpertMatrix; experts of a layer share shapes and formats."""

    def __init__(self, layers: list[tuple[ExpertMatrix, ExpertMatrix, ExpertMatrix]],
                 arithmetic: str = "float", path: str | os.PathLike | None = None,
                 version: tuple | None = None):
        self.layers, self.arithmetic, self.path = layers, arithmetic, path
        self.version = version  # (st_dev, st_ino, st_size, st_mtime_ns) of the mapped file
        self._fd: int | None = None
        self.reader: DirectReader | None = None  # `read_direct`: uncached experts off the disk
        self._warm: dict[tuple[int, int], int] = {}  # (layer, matrix) -> asks left unlooked
        self.n_experts = int(layers[0][0].data.shape[0]) if layers else 0
        for gate, up, down in layers:
            for m in (gate, up, down):
                self.check(m)
            if gate.ggml_type != up.ggml_type:
                raise ModelFormatError(f"{gate.name} is {gate.ggml_type.name} but {up.name} is "
                                       f"{up.ggml_type.name}: expert gate and up must share a "
                                       "format (they run as one fused matrix)")

    def check(self, m: ExpertMatrix) -> None:
        """A missing kernel is an error now, at load, not at the first routed token."""
        q = qtype_from_gguf(m.ggml_type, m.name)
        if q not in ARITHMETIC[self.arithmetic]:
            raise UnsupportedQuantError(q.name, m.name)
        if m.data.shape[0] != self.n_experts:
            raise DimensionError(f"{m.name}: {m.data.shape[0]} experts, layer 0 has "
                                 f"{self.n_experts}")

    def begin_step(self, layer: int, experts) -> None:
        """`layer`'s step will load expert ids `experts`: staged experts of other layers than
        it and the next, and its own it does not load (wrong predictions), are dropped; then
        its loads are asked for (`advise`)."""
        experts = list(experts)
        if self.reader is not None:
            loads = set(experts)
            self.reader.keep(lambda key: key[0] == layer + 1 or key[0] == layer and key[1]
                             in loads)
        self.advise(layer, experts)

    def advise(self, layer: int, experts) -> None:
        """Ask the kernel to read the ranges of `layer`'s expert ids `experts` into the page
        cache ahead of use (posix_fadvise WILLNEED: the reads run in the kernel, overlapping
        our compute, with no thread of ours and no GIL). Each expert's own pages are looked at
        every time (one mincore over its range, a few us): a range whose every page is cached
        is skipped, and one the kernel has dropped since an earlier look is asked for again.
        (A tensor-wide look trusted for later asks let an expert dropped meanwhile be faulted
        in unadvised, each fault reading 8 MiB around it: after the kernel dropped a running
        model's pages, a decode token read 617 MB from disk for 78 MB of experts,
        docs/PERFORMANCE.md.) With direct reads on (`read_direct`), an expert with any page
        not cached is staged instead: its three ranges read off the disk into a staging buffer
        by the reader's threads (reader.py), bypassing the page cache; if no buffer can be had,
        it is advised as above. A no-op without a file path or offsets."""
        experts = list(experts)
        mats = [m for m in self.layers[layer] if m.offset >= 0]
        if not experts or self.path is None or not mats:
            return
        cold = {e: [not self._cached(m, e) for m in mats] for e in experts}
        if any(any(c) for c in cold.values()):
            self._warm.clear()  # the kernel drops pages: no tensor is trusted unlooked
        if self.reader is not None and len(mats) == len(self.layers[layer]):
            cold = {e: c for e, c in cold.items() if not any(c) or not self.reader.stage(
                (layer, e), [m.byte_range(e) for m in mats])}
        if not hasattr(os, "posix_fadvise"):
            return
        for i, m in enumerate(mats):  # in file order: each tensor's experts by id
            for e, c in cold.items():
                if c[i]:
                    if self._fd is None:
                        self._fd = os.open(self.path, os.O_RDONLY)
                    os.posix_fadvise(self._fd, *m.byte_range(e), os.POSIX_FADV_WILLNEED)

    @staticmethod
    def _cached(m: ExpertMatrix, e: int) -> bool:
        """Whether every page of expert e's range of `m` is in the page cache. Its first page
        is looked at alone first (a few us): an expert the kernel dropped is usually dropped
        whole, and the range's look (~10-20 us: the kernel walks the cache page by page) is
        then not needed."""
        first = resident_pages(m.address(e), 1)
        if first is not None and not first[0]:
            return False
        pages = resident_pages(m.address(e), m.data[0].nbytes)
        return pages is not None and bool(pages.all())

    def read_direct(self, experts: int) -> bool:
        """Read uncached experts off the disk (O_DIRECT where the filesystem allows) into
        staging buffers for at most `experts` experts; 0 switches it off (reads through the
        page cache). Staging is outside the expert budget: its bytes are `reader.allocated`
        (at most `experts` x `staged_bytes()`). The bytes read are the file's, from a
        descriptor checked to be the mapped version of it: nothing computed changes. -> on?
        (Off, with a warning, when the file cannot be opened or has changed since it was
        mapped.)"""
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if experts > 0 and self.path is not None:
            one = self.staged_bytes()
            try:
                self.reader = DirectReader(self.path, experts * one, one, self.version)
            except OSError as e:
                warnings.warn(f"expert reads stay on the page cache: {e}", RuntimeWarning,
                              stacklevel=2)
        return self.reader is not None

    def staged_bytes(self) -> int:
        """Staging bytes of the largest layer's expert: each matrix's range rounded out to
        the reader's alignment, wherever it starts."""
        return max(sum(span_bound(m.data[0].nbytes) for m in mats)
                   for mats in self.layers) if self.layers else 0

    @contextmanager
    def expert_bytes(self, layer: int, e: int):
        """Expert e's (gate, up, down) bytes as `raw(e)` gives them (shape, dtype): the staged
        copy when the reader has one (waiting for its reads; its buffer held until the block
        ends), else the mapped file."""
        mats, reader = self.layers[layer], self.reader
        got = None if reader is None else reader.take((layer, e))
        if got is None:
            yield [m.raw(e) for m in mats]
            return
        try:
            yield [v.view(m.data.dtype).reshape(m.data.shape[1:])
                   for v, m in zip(got, mats, strict=True)]
        finally:
            reader.release((layer, e))

    def cached(self, layer: int) -> bool:
        """Whether every expert byte of `layer` is in the OS page cache (so nothing of it is
        worth reading ahead). One mincore over each whole tensor (~20 us for 13 MB); a tensor
        found wholly cached is trusted to stay so for its next WARM_ASKS asks, unlooked, until
        `advise` finds a dropped page of any tensor (then every tensor is looked at again).
        Only whether to predict depends on it: `advise` looks at each expert it is asked
        for."""
        return self.path is not None and all(
            self._look(layer, i) for i, m in enumerate(self.layers[layer]) if m.offset >= 0)

    def _look(self, layer: int, i: int) -> bool:
        left = self._warm.get((layer, i), 0)  # (advise may clear the table meanwhile)
        if left > 0:
            self._warm[layer, i] = left - 1
            return True
        m = self.layers[layer][i]
        pages = resident_pages(m.address(0), m.data.shape[0] * m.data.strides[0])
        if pages is not None and pages.all():
            self._warm[layer, i] = WARM_ASKS
            return True
        return False

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
            self.reader = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def raw_bytes(self, layer: int) -> int:
        """File bytes one expert of `layer` occupies (gate + up + down)."""
        return sum(m.raw(0).nbytes for m in self.layers[layer])

    def build(self, layer: int, e: int, raws=None) -> tuple[QuantWeight, QuantWeight]:
        """Expert e of `layer` -> (gate|up (2 ff, dim), down (dim, ff)), freshly repacked
        (from `raws`, its (gate, up, down) bytes as `expert_bytes` gives them, or the mapped
        file)."""
        gate, up, down = self.layers[layer]
        g, u, d = raws if raws is not None else (m.raw(e) for m in self.layers[layer])
        name = f"blk.{layer}.expert{e}"
        raw = np.concatenate([_rows(g, gate.rows), _rows(u, up.rows)])
        gu = QuantWeight.from_gguf(name + ".gate_up", gate.ggml_type, raw,
                                   (gate.rows + up.rows, gate.cols), arithmetic=self.arithmetic)
        dn = QuantWeight.from_gguf(name + ".down", down.ggml_type, d,
                                   (down.rows, down.cols), arithmetic=self.arithmetic)
        return gu, dn


def _rows(a: np.ndarray, rows: int) -> np.ndarray:
    return np.asarray(a).reshape(rows, -1)
