"""The sub-block formats (Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K) beyond what the all-format tests cover:
every byte value in every packed field, non-finite scales, real model shapes kernel vs twin, and
the typed error for rows that split a 256-weight super-block.

Batch invariance, accuracy against float64 and the quantizer-data round trips run for these
formats in test_quant_invariance.py, test_quant_kernels.py and test_quant_dequantize.py.
"""

import numpy as np
import pytest
from quant_data import (
    BLOCK_FORMATS,
    assert_bits_equal,
    finite_f16_bits,
    quantized,
    random_blocks,
    reference,
)

from cfr_atlas.errors import DimensionError
from cfr_atlas.models.gguf_io import GGUFFile
from cfr_atlas.quant import BLOCKS, QType, QuantWeight, kquants, q4_0, q4_1, q5, q8_0, subblock
from cfr_atlas.quant.subblock import Fields, Offset
from cfr_atlas.quant.weight import CODECS

SUBBLOCK = [*q5.BLOCK_DTYPES, *kquants.BLOCK_DTYPES]


def _twin(w: QuantWeight, x: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    CODECS[w.qtype].matmul_numpy(x, w.tiles, out)
    return out


def _every_byte(qtype: QType) -> np.ndarray:
    """256 blocks in 4 rows of 64: block i holds byte value i in every packed field (quants,
    packed scales, high bits), so each field of each position sees every bit pattern; f16 scales
    random finite, subnormals and both zeros included."""
    dtype = BLOCK_FORMATS[qtype]
    raw = np.repeat(np.arange(256, dtype=np.uint8), dtype.itemsize).reshape(4, -1)
    blocks = raw.view(dtype)
    rng = np.random.default_rng(qtype.value)
    for field in (f for f in dtype.names if dtype[f] == np.dtype("<f2")):
        blocks[field] = finite_f16_bits(rng, blocks.shape).view(np.float16)
    blocks.reshape(-1)[:2]["d"] = [0.0, -0.0]
    return raw


@pytest.mark.parametrize("qtype", SUBBLOCK)
def test_every_byte_value(qtype):
    raw = _every_byte(qtype)
    shape = (4, 64 * BLOCKS[qtype].elements)
    ref = reference(qtype, raw)
    assert_bits_equal(CODECS[qtype].dequantize(raw), ref)
    w = QuantWeight.from_raw("w", qtype, raw, shape)
    assert_bits_equal(w.dequantize(), ref)
    x = np.random.default_rng(1).standard_normal((3, shape[1])).astype(np.float32)
    np.testing.assert_array_equal(w.matmul(x), _twin(w, x))


@pytest.mark.parametrize("qtype", SUBBLOCK)
def test_random_bytes_with_non_finite_scales(qtype):
    """Uniform random bytes everywhere, f16 infinities and NaNs included: NaN payloads and
    infinities come out exactly as gguf-py's."""
    k = 4 * BLOCKS[qtype].elements
    raw = np.random.default_rng(qtype.value).integers(0, 256, (64, k // BLOCKS[qtype].elements
                                                               * BLOCKS[qtype].bytes),
                                                      dtype=np.uint8)
    with np.errstate(invalid="ignore"):
        ref = reference(qtype, raw)
        assert not np.isfinite(ref).all()  # the case is not vacuous
        assert_bits_equal(CODECS[qtype].dequantize(raw), ref)
        assert_bits_equal(QuantWeight.from_raw("w", qtype, raw, (64, k)).dequantize(), ref)


@pytest.mark.parametrize("qtype", SUBBLOCK)
@pytest.mark.parametrize("rows, blocks", [(1, 1), (17, 2), (70, 3)])
@pytest.mark.parametrize("t", [1, 2, 5])
def test_kernel_equals_twin(qtype, rows, blocks, t):
    k = blocks * BLOCKS[qtype].elements
    w = QuantWeight.from_raw("w", qtype, quantized(qtype, rows, k, seed=t), (rows, k))
    x = np.random.default_rng(rows).standard_normal((t, k)).astype(np.float32)
    np.testing.assert_array_equal(w.matmul(x).view(np.uint32), _twin(w, x).view(np.uint32))


# Real (N, K) shapes in the formats the Q4_K_M files store them in: Qwen2.5-0.5B's ffn_down
# (Q4_K, Q6_K) and ffn_gate (Q5_0), Gemma 3 270M's ffn_down (Q4_K, Q6_K), attn_output (Q4_K) and
# ffn_gate (Q5_0, its K = 640 splits a super-block); the other formats at K = 4864.
@pytest.mark.parametrize("qtype, shape", [
    (QType.Q4_K, (896, 4864)), (QType.Q6_K, (896, 4864)), (QType.Q5_0, (4864, 896)),
    (QType.Q4_K, (640, 2048)), (QType.Q6_K, (640, 2048)), (QType.Q4_K, (640, 1024)),
    (QType.Q5_0, (2048, 640)), (QType.Q5_K, (256, 4864)), (QType.Q2_K, (128, 4864)),
    (QType.Q3_K, (128, 4864)), (QType.Q5_1, (128, 4864)), (QType.IQ4_NL, (128, 4864)),
])
def test_real_shapes_kernel_equals_twin(qtype, shape):
    raw = random_blocks(qtype, *shape, np.random.default_rng(5))
    w = QuantWeight.from_raw("w", qtype, raw, shape)
    x = np.random.default_rng(6).standard_normal((3, shape[1])).astype(np.float32)
    y = w.matmul(x)
    np.testing.assert_array_equal(y.view(np.uint32), _twin(w, x).view(np.uint32))
    assert_bits_equal(y[1], w.matvec(x[1]))


@pytest.mark.parametrize("qtype", list(kquants.BLOCK_DTYPES))
def test_row_splitting_a_super_block_is_a_typed_error(qtype):
    """Gemma 3 270M's dim 640 is 2.5 super-blocks: such rows cannot be K-quants."""
    raw = np.zeros((4, 3 * BLOCKS[qtype].bytes), dtype=np.uint8)
    with pytest.raises(DimensionError, match=rf"blk.0.ffn_down.weight: row size 640 is not a "
                                             rf"positive multiple of the {qtype.name} block size "
                                             rf"256"):
        QuantWeight.from_raw("blk.0.ffn_down.weight", qtype, raw, (4, 640))


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma3-270m", "qwen2.5-coder-0.5b"])
def test_real_file_tensors(real_model, name):
    """The first and last layer tensor of each sub-block format in a real file (fetched like
    every real-model test): dequantization bitwise equal to gguf-py's, and the kernel equal to
    its twin. Layer tensors only: the 136-168M-weight embeddings and heads run through these
    same kernels in the real-model conformance tests, and gguf-py's dequantization of one takes
    ~10 s here. Tensors are found by the engine's reader (gguf's, vocabulary parsed lazily)."""
    by_type: dict[QType, list] = {}
    for t in GGUFFile(real_model(name)).reader.tensors:
        if (t.name.startswith("blk.") and t.tensor_type.name in QType.__members__
                and QType[t.tensor_type.name] in SUBBLOCK):
            by_type.setdefault(QType[t.tensor_type.name], []).append(t)
    assert {QType.Q5_0, QType.Q4_K, QType.Q6_K} <= set(by_type), sorted(by_type)
    for qtype, tensors in by_type.items():
        for t in (tensors[0], tensors[-1]):
            shape = (int(t.shape[1]), int(t.shape[0]))
            w = QuantWeight.from_gguf(t.name, t.tensor_type, t.data, shape)
            assert_bits_equal(w.dequantize(), reference(qtype, t.data).reshape(shape))
            x = np.random.default_rng(0).standard_normal((2, shape[1])).astype(np.float32)
            np.testing.assert_array_equal(w.matmul(x), _twin(w, x))


@pytest.mark.parametrize("qtype, unpack, offset", [
    (QType.Q8_0, lambda raw: Fields(*q8_0._fields(raw)[:1], None, q8_0._fields(raw)[1]),
     Offset.NONE),
    (QType.Q4_0, lambda raw: Fields(*q4_0._fields(raw)[:1], None, q4_0._fields(raw)[1]),
     Offset.NONE),
    (QType.Q4_1, lambda raw: Fields(*q4_1._fields(raw)[:2], q4_1._fields(raw)[2].view(np.int8)),
     Offset.ADD),
])
def test_fast_repacks_equal_the_fields_route(qtype, unpack, offset):
    """Q8_0, Q4_0 and Q4_1 repack their bytes straight into subblock Tiles (faster at load);
    the generic route (unpack to Fields, then subblock's repack) gives the same tiles, hence
    the same kernel results, bit for bit."""
    raw = quantized(qtype, 70, 192, seed=3)
    via_fields = subblock.codec(qtype, unpack, 32, offset)
    fast, generic = CODECS[qtype].repack(raw), via_fields.repack(raw)
    for got, want in zip(fast, generic, strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want)
    x = np.random.default_rng(4).standard_normal((5, 192)).astype(np.float32)
    ours, theirs = (np.empty((5, 70), dtype=np.float32) for _ in range(2))
    via_fields.matmul(x, generic, ours)
    CODECS[qtype].matmul(x, fast, theirs)
    assert_bits_equal(ours, theirs)
    assert_bits_equal(via_fields.dequantize(raw), CODECS[qtype].dequantize(raw))
