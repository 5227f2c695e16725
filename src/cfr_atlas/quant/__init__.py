"""Quantized weights: the format table and the one weight type the model multiplies by.

`QType` (GGML ids) and `BLOCKS` (block elements, block bytes) describe the formats; `QuantWeight`
holds one matrix repacked into row tiles and offers matvec / matmul / dequantize / rows, batch
invariant bit for bit. One module per format (q8_0, q4_0, q4_1, floats) holds its byte layout,
dequantizer, repack, numba kernel and NumPy twin; tiles.py states the layout and reduction order.
The formats whose weights are a per-sub-block scale times an integer (plus an offset) share
subblock.py's tiles, kernels and twin and only unpack their bytes: q5 (Q5_0, Q5_1, IQ4_NL) and
kquants (Q2_K, Q3_K, Q4_K, Q5_K, Q6_K).
int8.py holds the integer path (activations quantized per block,
`QuantWeight.from_raw(arithmetic=)`), int8_fields.py and int8_sub16.py its sub-block formats.
This package imports nothing of cfr_atlas but `cfr_atlas.errors`.
"""

from cfr_atlas.quant.formats import BLOCKS, BlockSize, Codec, QType, qtype_from_gguf, row_bytes
from cfr_atlas.quant.tiles import TILE_ROWS
from cfr_atlas.quant.weight import CODECS, QuantWeight

__all__ = [
    "BLOCKS",
    "CODECS",
    "TILE_ROWS",
    "BlockSize",
    "Codec",
    "QType",
    "QuantWeight",
    "qtype_from_gguf",
    "row_bytes",
]
