"""Benchmark-only GGUF variants: the same model's weights in another quant format.

`requantize(src, dst, qtype)` dequantizes every 2-D weight matrix of `src` with gguf-py and
quantizes it again with gguf-py's quantizers (`gguf.quants.quantize`, bit-exact ports of
ggml's reference `quantize_row_*_ref`). What it keeps, as llama-quantize keeps it:
  * 1-D tensors (norm weights, biases, rope factors) stay as stored (F32);
  * the token embedding keeps its stored type (SmolLM2's is Q8_0 and tied to the output head;
    llama-quantize would give a tied head a higher type, never a 4-bit one);
  * all metadata and the tokenizer are copied field by field; `general.file_type` is set to the
    new format's LlamaFileType.
Nothing here ships: bench_decode.py writes the variants into a temporary folder.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

FILE_TYPES = {
    "Q4_0": LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1,
    "Q8_0": LlamaFileType.MOSTLY_Q8_0,
}
KEEP_TYPE = ("token_embd.weight",)  # stored type kept, as llama-quantize keeps a tied head high


def new_type(tensor, qtype: GGMLQuantizationType) -> GGMLQuantizationType:
    """The type `tensor` gets in the variant: `qtype` for 2-D weights, else unchanged."""
    if len(tensor.shape) < 2 or tensor.name in KEEP_TYPE:
        return tensor.tensor_type
    return qtype


def _copy_fields(r: GGUFReader, w: GGUFWriter, file_type: int) -> None:
    for f in r.fields.values():
        if f.name.startswith("GGUF.") or f.name in ("general.architecture", "general.file_type"):
            continue  # written by GGUFWriter itself, or replaced below
        sub = f.types[-1] if f.types[0] == GGUFValueType.ARRAY else None
        w.add_key_value(f.name, f.contents(), f.types[0], sub_type=sub)
    w.add_key_value("general.file_type", int(file_type), GGUFValueType.UINT32)


def requantize(src, dst, qtype: str) -> Path:
    """Write `src` with its 2-D weights in `qtype` ("Q4_0", "Q4_1" or "Q8_0") to `dst`."""
    target = GGMLQuantizationType[qtype]
    r = GGUFReader(src)
    dst = Path(dst)
    tmp = dst.with_name(dst.name + ".tmp")
    w = GGUFWriter(tmp, r.fields["general.architecture"].contents())
    _copy_fields(r, w, FILE_TYPES[qtype])
    for t in r.tensors:
        kind = new_type(t, target)
        data = t.data
        if kind != t.tensor_type:
            dense = dequantize(np.asarray(data), t.tensor_type).astype(np.float32)
            data = quantize(dense, kind)
        w.add_tensor(t.name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst


def variants(src, folder, qtypes=("Q4_1", "Q4_0", "Q8_0")) -> dict[str, Path]:
    """{qtype: path}: `src` itself for its own main type, requantized files for the others."""
    r = GGUFReader(src)
    own = LlamaFileType(int(r.fields["general.file_type"].contents())).name.removeprefix(
        "MOSTLY_")
    out = {}
    for q in qtypes:
        out[q] = Path(src) if q == own else requantize(src, Path(folder) / f"model.{q}.gguf", q)
    return out
