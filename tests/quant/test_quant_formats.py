"""The format table against gguf-py's, the GGUF type mapping and its typed errors."""

import gguf
import pytest
from gguf import GGMLQuantizationType as G

from cfr_atlas.errors import DimensionError, UnsupportedQuantError
from cfr_atlas.quant import BLOCKS, QType, QuantWeight, qtype_from_gguf, row_bytes
from cfr_atlas.quant.weight import CODECS


@pytest.mark.parametrize("qtype", list(QType))
def test_table_matches_gguf(qtype):
    ggml = G[qtype.name]
    assert qtype.value == ggml.value
    assert tuple(BLOCKS[qtype]) == gguf.GGML_QUANT_SIZES[ggml]
    assert qtype_from_gguf(ggml, "t") is qtype
    assert CODECS[qtype].qtype is qtype


@pytest.mark.parametrize("ggml", [G.IQ4_XS, G.IQ2_XXS, G.TQ2_0, G.Q8_K, G.F64])
def test_unsupported_type_is_a_typed_error(ggml):
    with pytest.raises(UnsupportedQuantError) as info:
        qtype_from_gguf(ggml, "blk.3.ffn_down.weight")
    assert info.value.qtype == ggml.name
    assert info.value.tensor == "blk.3.ffn_down.weight"
    assert ggml.name in str(info.value) and "blk.3.ffn_down.weight" in str(info.value)


def test_from_raw_refuses_unsupported_type():
    with pytest.raises(UnsupportedQuantError, match="IQ4_XS"):
        QuantWeight.from_raw("output.weight", G.IQ4_XS, b"", (1, 256))


def test_row_bytes():
    assert row_bytes(QType.Q4_1, 576) == 576 // 32 * (2 + 2 + 16)
    assert row_bytes(QType.Q8_0, 1536) == 1536 // 32 * (2 + 32)
    assert row_bytes(QType.BF16, 7) == 14
    with pytest.raises(DimensionError, match=r"row size 100 .* Q4_0 block size 32"):
        row_bytes(QType.Q4_0, 100)
    with pytest.raises(DimensionError, match=r"row size 896 .* Q4_K block size 256"):
        row_bytes(QType.Q4_K, 896)
    assert row_bytes(QType.Q6_K, 4864) == 19 * (128 + 64 + 16 + 2)
