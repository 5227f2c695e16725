"""`ExpertSource`: where routed-expert weights come from — the memory-mapped GGUF.

An expert's gate, up and down matrices are the e-th (rows, row_bytes) slab of the 3-D tensors
ffn_{gate,up,down}_exps (GGUF ne = [cols, rows, n_experts]): one contiguous byte range each.
`build` repacks one expert into QuantWeights (gate|up fused when they share a format, as the
dense FFN is); `check` refuses, at load, a format with no kernel (UnsupportedQuantError).
This module reads arrays it is handed; it does not open files or know tensor names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from cfr_atlas.errors import DimensionError, ModelFormatError, UnsupportedQuantError
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
                 arithmetic: str = "float", path: str | os.PathLike | None = None):
        self.layers, self.arithmetic, self.path = layers, arithmetic, path
        self._fd: int | None = None
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

    def advise(self, layer: int, experts) -> None:
        """Ask the kernel to read the ranges of `layer`'s expert ids `experts` into the page
        cache ahead of use (posix_fadvise WILLNEED: the reads run in the kernel, overlapping
        our compute, with no thread of ours and no GIL). Each expert's own pages are looked at
        every time (one mincore over its range, a few us): a range whose every page is cached
        is skipped, and one the kernel has dropped since an earlier look is asked for again.
        (A tensor-wide look trusted for later asks let an expert dropped meanwhile be faulted
        in unadvised, each fault reading 8 MiB around it: after the kernel dropped a running
        model's pages, a decode token read 617 MB from disk for 78 MB of experts,
        docs/PERFORMANCE.md.) A no-op without a file path or offsets."""
        experts = list(experts)
        if not experts or self.path is None or not hasattr(os, "posix_fadvise"):
            return
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        for m in self.layers[layer]:
            if m.offset < 0:
                continue
            n = m.data[0].nbytes
            for e in experts:
                pages = resident_pages(m.address(e), n)
                if pages is not None and pages.all():
                    continue
                os.posix_fadvise(self._fd, *m.byte_range(e), os.POSIX_FADV_WILLNEED)
                self._warm.clear()  # the kernel drops pages: no tensor is trusted unlooked

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
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def raw_bytes(self, layer: int) -> int:
        """File bytes one expert of `layer` occupies (gate + up + down)."""
        return sum(m.raw(0).nbytes for m in self.layers[layer])

    def build(self, layer: int, e: int) -> tuple[QuantWeight, QuantWeight]:
        """Expert e of `layer` -> (gate|up (2 ff, dim), down (dim, ff)), freshly repacked."""
        gate, up, down = self.layers[layer]
        name = f"blk.{layer}.expert{e}"
        raw = np.concatenate([_rows(gate.raw(e), gate.rows), _rows(up.raw(e), up.rows)])
        gu = QuantWeight.from_gguf(name + ".gate_up", gate.ggml_type, raw,
                                   (gate.rows + up.rows, gate.cols), arithmetic=self.arithmetic)
        dn = QuantWeight.from_gguf(name + ".down", down.ggml_type, down.raw(e),
                                   (down.rows, down.cols), arithmetic=self.arithmetic)
        return gu, dn


def _rows(a: np.ndarray, rows: int) -> np.ndarray:
    return np.asarray(a).reshape(rows, -1)
