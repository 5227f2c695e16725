"""QuantWeight at the boundary: GGUF's shape convention, typed errors carrying the numbers, out=."""

import gguf
import numpy as np
import pytest
from quant_data import GGML, assert_bits_equal, cols, quantized, reference

from cfr_atlas.errors import DimensionError
from cfr_atlas.quant import QType, QuantWeight


@pytest.fixture(scope="module")
def w():
    return QuantWeight.from_raw("blk.0.attn_q.weight", QType.Q4_1,
                                quantized(QType.Q4_1, 48, 64), (48, 64))


def test_gguf_file_round_trip(tmp_path):
    """A GGUF stores (N, K) as tensor.shape [K, N] with data (N, row_bytes) or (N, K)."""
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    raws = {qt: quantized(qt, 40, cols(qt, 64), seed=qt.value) for qt in QType}
    for qt, raw in raws.items():
        writer.add_tensor(qt.name, raw, raw_dtype=GGML[qt])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for t in gguf.GGUFReader(path).tensors:
        k = cols(QType[t.name], 64)
        assert [int(s) for s in t.shape] == [k, 40]
        w = QuantWeight.from_gguf(t.name, t.tensor_type, t.data, (int(t.shape[1]),
                                                                  int(t.shape[0])))
        assert w.shape == (40, k) and w.qtype is QType[t.name]
        assert_bits_equal(w.dequantize(), reference(w.qtype, raws[w.qtype]))


def test_api_shapes_and_out(w):
    x = np.ones(64, dtype=np.float32)
    out = np.empty(48, dtype=np.float32)
    assert w.matvec(x, out=out) is out and out.shape == (48,)
    X = np.ones((5, 64), dtype=np.float32)
    out2 = np.empty((5, 48), dtype=np.float32)
    assert w.matmul(X, out=out2) is out2
    assert w.matmul(np.empty((0, 64), dtype=np.float32)).shape == (0, 48)
    deq = np.empty((48, 64), dtype=np.float32)
    assert w.dequantize(out=deq) is deq
    assert repr(w) == f"QuantWeight('blk.0.attn_q.weight', Q4_1, (48, 64), {w.nbytes} bytes)"


@pytest.mark.parametrize("raw, shape, match", [
    (np.zeros((48, 30), np.uint8), (48, 64), r"1440 bytes of Q4_1 data, but shape \(48, 64\) "
                                             r"needs 1920"),
    (np.zeros((48, 40), np.uint8), (48, 100), r"row size 100 .* block size 32"),
    (np.zeros((48, 40), np.float32), (48, 64), r"Q4_1 data must be uint8, got float32"),
    (np.zeros((0, 40), np.uint8), (0, 64), r"at least one row"),
    (np.zeros((48, 40), np.uint8), (48, 64, 1), r"shape must be \(N, K\), got \(48, 64, 1\)"),
])
def test_from_raw_errors(raw, shape, match):
    with pytest.raises(DimensionError, match=match):
        QuantWeight.from_raw("t", QType.Q4_1, raw, shape)


def test_float_raw_dtype_must_match():
    with pytest.raises(DimensionError, match="F16 data must be float16 or uint8, got float32"):
        QuantWeight.from_raw("t", QType.F16, np.zeros((4, 8), np.float32), (4, 8))


@pytest.mark.parametrize("x, match", [
    (np.ones(63, np.float32), r"x must be C-contiguous float32 \(64,\), got float32 \(63,\)"),
    (np.ones(64, np.float64), r"got float64 \(64,\)"),
    (np.ones((1, 64), np.float32), r"got float32 \(1, 64\)"),
    (np.ones(128, np.float32)[::2], r"got float32 non-contiguous \(64,\)"),
    ([1.0] * 64, r"got list"),
])
def test_matvec_rejects(w, x, match):
    with pytest.raises(DimensionError, match=match):
        w.matvec(x)


@pytest.mark.parametrize("x, out, match", [
    (np.ones(64, np.float32), None, r"x must be float32 \(T, 64\), got float32 \(64,\)"),
    (np.ones((3, 65), np.float32), None, r"\(3, 64\), got float32 \(3, 65\)"),
    (np.ones((3, 128), np.float32)[:, :64], None, r"non-contiguous \(3, 64\)"),
    (np.ones((3, 64), np.float32), np.empty((3, 47), np.float32), r"out must be .*\(3, 48\)"),
    (np.ones((3, 64), np.float32), np.empty((3, 48), np.float64), r"out .* got float64"),
])
def test_matmul_rejects(w, x, out, match):
    with pytest.raises(DimensionError, match=match):
        w.matmul(x, out=out)


@pytest.mark.parametrize("ids, match", [
    ([0, 48], r"row id 48 out of range for 48 rows"),
    ([-1], r"row id -1 out of range"),
    ([[1, 2]], r"1-D integers"),
    ([1.0], r"1-D integers"),
])
def test_rows_rejects(w, ids, match):
    with pytest.raises(DimensionError, match=match):
        w.rows(ids)


def test_rows_rejects_bad_out(w):
    with pytest.raises(DimensionError, match=r"out must be C-contiguous float32 \(2, 64\)"):
        w.rows([1, 2], out=np.empty((3, 64), np.float32))
