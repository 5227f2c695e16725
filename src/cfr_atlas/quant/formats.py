"""The one table of weight formats: GGML type ids, block sizes, what a format module provides.

`QType` carries the GGML ids; `BLOCKS` gives `(block elements, block bytes)` per format with the
bytes written as their parts, so every size elsewhere derives from here. `Codec` is the set of
functions a format module fills in; `QuantWeight` picks one by `QType` and never branches on the
format itself. This module holds no arithmetic and imports no format module (they import it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import gguf
import numpy as np

from cfr_atlas.errors import DimensionError, UnsupportedQuantError


class QType(Enum):
    """Weight formats cfr-atlas implements; values are the GGML type ids used in GGUF files."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ4_NL = 20
    BF16 = 30


class BlockSize(NamedTuple):
    elements: int  # weights per block
    bytes: int  # bytes per block


BLOCKS: dict[QType, BlockSize] = {
    QType.F32: BlockSize(1, 4),
    QType.F16: BlockSize(1, 2),
    QType.BF16: BlockSize(1, 2),
    QType.Q4_0: BlockSize(32, 2 + 16),  # f16 scale d, 32 x 4-bit q
    QType.Q4_1: BlockSize(32, 2 + 2 + 16),  # f16 scale d, f16 min m, 32 x 4-bit q
    QType.Q8_0: BlockSize(32, 2 + 32),  # f16 scale d, 32 x int8 q
    QType.Q5_0: BlockSize(32, 2 + 4 + 16),  # f16 d, 32 high bits, 32 x 4-bit low q
    QType.Q5_1: BlockSize(32, 2 + 2 + 4 + 16),  # f16 d, f16 min m, 32 high bits, 32 x 4-bit q
    QType.IQ4_NL: BlockSize(32, 2 + 16),  # f16 d, 32 x 4-bit codebook index
    # K-quants: 256-weight super-blocks of 16 or 32-weight sub-blocks with their own scales
    QType.Q2_K: BlockSize(256, 16 + 64 + 2 + 2),  # 4-bit sc|m x 16, 256 x 2-bit q, d, dmin
    QType.Q3_K: BlockSize(256, 32 + 64 + 12 + 2),  # high bits, 2-bit q, 16 x 6-bit sc, d
    QType.Q4_K: BlockSize(256, 2 + 2 + 12 + 128),  # d, dmin, 8 x 6-bit sc and m, 4-bit q
    QType.Q5_K: BlockSize(256, 2 + 2 + 12 + 32 + 128),  # as Q4_K plus 256 high bits
    QType.Q6_K: BlockSize(256, 128 + 64 + 16 + 2),  # 4-bit low q, 2-bit high q, 16 x i8 sc, d
}


def qtype_from_gguf(ggml_type: gguf.GGMLQuantizationType | QType, tensor: str) -> QType:
    """The QType of a GGUF tensor type; UnsupportedQuantError(type name, tensor) for the rest."""
    if isinstance(ggml_type, QType):
        return ggml_type
    try:
        return QType(int(ggml_type))
    except ValueError:
        name = getattr(ggml_type, "name", str(ggml_type))
        raise UnsupportedQuantError(name, tensor) from None


def row_bytes(qtype: QType, cols: int) -> int:
    """Bytes of one stored row of `cols` weights; DimensionError if cols splits a block."""
    block = BLOCKS[qtype]
    if cols <= 0 or cols % block.elements:
        raise DimensionError(
            f"row size {cols} is not a positive multiple of the {qtype.name} block size "
            f"{block.elements}"
        )
    return cols // block.elements * block.bytes


@dataclass(frozen=True)
class Codec:
    """What one format provides. `raw` is uint8 (rows, row_bytes) as stored in the GGUF; `tiles`
    is the format's repacked NamedTuple; `x` (T, K) float32 and `out` (T, N) float32.

    matmul and matmul_numpy (the twin) compute out = x @ W.T with the same per-element
    operation order (see tiles.py), so they agree bit for bit.
    """

    qtype: QType
    raw_dtype: np.dtype  # element dtype gguf's reader hands out (uint8 for block formats)
    dequantize: Callable[[np.ndarray], np.ndarray]  # raw -> (rows, cols) float32
    repack: Callable[[np.ndarray], tuple]  # raw -> tiles
    unpack_rows: Callable[..., np.ndarray]  # (tiles, ids or slice, out) -> (n, cols) float32
    matmul: Callable[[np.ndarray, tuple, np.ndarray], None]  # numba kernel, fills out
    matmul_numpy: Callable[[np.ndarray, tuple, np.ndarray], None]  # the NumPy twin
