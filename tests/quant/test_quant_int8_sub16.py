"""The integer path of the K-quants with sub-blocks of 16 (quant/int8_sub16.py): Q6_K and Q3_K.
Kernel bit for bit equal to its NumPy twin, the portable IR equal to the AVX2 intrinsics, the
exact integer dots at the int16 bound (Q6_K's extremes), the scale layout, reads equal to the
float codec's bits and the integer SIMD in the emitted assembly. Edge scales and non-finite
activations, batch invariance and the error bound against float64 run for them in
test_quant_int8.py (EVERY_INT8)."""

import numba
import numpy as np
import pytest
from quant_data import assert_bits_equal, edge_raw, quantized, random_blocks
from test_quant_int8 import _cpu_flags, _twin, _x

from cfr_atlas.quant import QType, QuantWeight, int8, int8_sub16, kquants
from cfr_atlas.quant.tiles import TILE_ROWS
from cfr_atlas.quant.weight import CODECS, INT8_CODECS, INT8_SUB16

FORMATS = list(INT8_SUB16)
SHAPES = [(1, 256), (17, 512), (70, 768)]  # rows: one, not a multiple of the tile, 2 tiles +


def _int8(qtype, raw, shape) -> QuantWeight:
    return QuantWeight.from_raw("w", qtype, raw, shape, arithmetic="int8")


def test_q6_k_and_q3_k_have_an_integer_codec():
    assert set(FORMATS) == {QType.Q6_K, QType.Q3_K}
    for qt in FORMATS:
        assert INT8_CODECS[qt] is not CODECS[qt]
    assert INT8_CODECS[QType.Q2_K] is CODECS[QType.Q2_K]  # an offset per 16: float under int8


@pytest.mark.parametrize("qtype", FORMATS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("t", [1, 2, 3, 7])
def test_kernel_equals_twin(qtype, shape, t):
    w = _int8(qtype, quantized(qtype, *shape, seed=t), shape)
    x = _x(t, shape[1], seed=shape[0])
    assert_bits_equal(w.matmul(x), _twin(w, x))


# --- exact integer dots at the int16 bound ------------------------------------------------------


def q6_k_raw(q: np.ndarray, sc: np.ndarray, d: np.ndarray) -> np.ndarray:
    """Q6_K bytes from q (n, K) 0..63 (stored values, w = q - 32), sc (n, K // 16) int8 and d
    (n, K // 256) -> (n, row_bytes) uint8 (kquants.py's layout comment)."""
    n, k = q.shape
    nb = k // 256
    qb = q.astype(np.uint8).reshape(n, nb, 2, 128)  # weight 128 a + e at [a, e]
    low = qb & 15
    high = (qb >> 4).reshape(n, nb, 2, 4, 32)  # weight 128 a + 32 i + j at [a, i, j]
    blocks = np.zeros((n, nb), dtype=kquants.Q6_K_BLOCK)
    blocks["ql"] = (low[..., :64] | (low[..., 64:] << 4)).reshape(n, nb, 128)
    blocks["qh"] = (high[..., 0, :] | (high[..., 1, :] << 2) | (high[..., 2, :] << 4)
                    | (high[..., 3, :] << 6)).reshape(n, nb, 64)
    blocks["scales"] = sc.reshape(n, nb, 16)
    blocks["d"] = d
    return blocks.view(np.uint8).reshape(n, -1)


def _extreme_q6_k(rng) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """d = 1; rows 0-3 at the extremes (w = -32 or 31 with sc = -128 or 127 everywhere), the
    rest random over the full ranges -> (raw, w (n, K) int64, sc (n, K // 16) int64)."""
    n, k = 37, 512
    q = rng.integers(0, 64, size=(n, k))
    sc = rng.integers(-128, 128, size=(n, k // 16))
    for row, (qv, sv) in enumerate(((0, -128), (0, 127), (63, -128), (63, 127))):
        q[row], sc[row] = qv, sv
    raw = q6_k_raw(q, sc.astype(np.int8), np.ones((n, k // 256), dtype=np.float16))
    split = kquants.q6_k_scaled(raw)  # the packer is the unpacker's inverse
    assert np.array_equal(split.q, q - 32) and np.array_equal(split.sc.reshape(n, -1), sc)
    return raw, q - 32, sc


def _integer_activations(rng, t: int, k: int) -> np.ndarray:
    """Integers in -127..127 with 127 in every block: each block's scale is 1, so they
    quantize to themselves. Rows 0, 1 all +127, all -127."""
    x = rng.integers(-127, 128, size=(t, k))
    x[:, ::32] = 127
    x[0], x[1] = 127, -127
    return x


def _exact(w: np.ndarray, sc: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's result with d = dx = 1: exact int64 block dots (sub-block dots times sc),
    accumulated block after block in float32."""
    n, t = w.shape[0], x.shape[0]
    halves = np.einsum("nhj,thj->tnh", w.reshape(n, -1, 16), x.reshape(t, -1, 16))
    blocks = (halves * sc).reshape(t, n, -1, 2).sum(axis=-1)
    assert np.abs(blocks).max() == 2 * 128 * 16 * 32 * 127  # the bound, reached
    acc = np.zeros((t, n), dtype=np.float32)
    for b in range(blocks.shape[-1]):
        acc = acc + blocks[..., b].astype(np.float32)  # each exact: |isum| < 2**24
    return acc


def test_block_dots_are_exact_at_the_int16_bound():
    """w = -32 against x = +-127 puts every int16 half-sum at 4 * 2 * 32 * 127 = 32,512 and the
    scaled block sum at 16,646,144; both kernels and the twin give the exact integers. (Summing
    all 8 chunks of a block in int16, or a weight of -128, would overflow here.)"""
    rng = np.random.default_rng(3)
    raw, w, sc = _extreme_q6_k(rng)
    x = _integer_activations(rng, 5, w.shape[1])
    expect = _exact(w, sc, x)
    weight = _int8(QType.Q6_K, raw, w.shape)
    xf = x.astype(np.float32)
    assert_bits_equal(weight.matmul(xf), expect)
    assert_bits_equal(_twin(weight, xf), expect)
    tiles = weight.tiles
    xq, xd, xsum = int8.quantize(xf)
    for regs in (True, False):
        portable = int8_sub16.tile_kernel(isa=int8.PORTABLE, in_registers=regs)
        out = np.empty_like(expect)
        portable(xq, xd, xsum, tiles.q, tiles.d, tiles.s, out)
        assert_bits_equal(out, expect)


def test_every_dot_and_kernel_gives_the_same_bits():
    """The portable IR, the AVX2 intrinsics and vpdpbusd (where the machine has VNNI), each
    in both kernels (int8.py's register kernel through PASS_WEIGHTS, this module's memory
    kernel), give the same bits on Q6_K and Q3_K bytes with edge scales, for 1 to 7 tokens
    (fours, a pair, one)."""
    kernels = [int8_sub16.tile_kernel(isa=isa, in_registers=regs)
               for isa in int8.ISAS for regs in (True, False)]
    for qtype in FORMATS:
        tiles = _int8(qtype, edge_raw(qtype, 70, 512, seed=11), (70, 512)).tiles
        for t in (1, 2, 3, 4, 7):
            xq, xd, xsum = int8.quantize(_x(t, 512, seed=t))
            got = [np.empty((t, 70), dtype=np.float32) for _ in kernels]
            for kernel, out in zip(kernels, got, strict=True):
                kernel(xq, xd, xsum, tiles.q, tiles.d, tiles.s, out)
            for other in got[1:]:
                assert_bits_equal(got[0], other)


# --- layout and reads ----------------------------------------------------------------------------


def test_scale_tile_layout():
    """to_scale_tiles puts the scale of row r, half h, block b at b * 2 * TILE_ROWS +
    scale_byte(r, h); gather_scale_rows reads any rows back."""
    assert [int8_sub16.scale_byte(r, h) for r, h in ((0, 0), (1, 0), (0, 1), (8, 0))] \
        == [0, 1, 8, 16]
    rng = np.random.default_rng(2)
    n, nb = 70, 3
    sc = rng.integers(-128, 128, size=(n, nb * 2)).astype(np.int8)
    sc[sc == 0] = 1
    tiles = int8_sub16.to_scale_tiles(sc)
    assert tiles.shape == (-(-n // TILE_ROWS), nb * 2 * TILE_ROWS)
    for row in (0, 7, 8, TILE_ROWS - 1, TILE_ROWS, n - 1):
        i, r = divmod(row, TILE_ROWS)
        for b in range(nb):
            for h in range(2):
                assert tiles[i, b * 2 * TILE_ROWS + int8_sub16.scale_byte(r, h)] \
                    == sc[row, 2 * b + h]
    rows = int8_sub16.gather_scale_rows(tiles, slice(None))
    assert np.array_equal(rows[:n], sc) and not rows[n:].any()  # the padding rows
    ids = np.array([69, 0, 33, 8, 8])
    assert np.array_equal(int8_sub16.gather_scale_rows(tiles, ids), sc[ids])


@pytest.mark.parametrize("qtype", FORMATS)
def test_reads_equal_the_float_codec_bits(qtype):
    """dequantize and rows give the float codec's bits, on random bytes whose f16 d include
    infinities and NaNs (a = d * sc, then a * q: the same float32 operations)."""
    rng = np.random.default_rng(9)
    raw = random_blocks(qtype, 45, 512, rng)
    blocks = raw.view(kquants.BLOCK_DTYPES[qtype])
    blocks["d"][:3, 0] = [np.inf, -np.inf, np.nan]
    ids = np.array([44, 0, 2, 16, 17, 2])
    with np.errstate(invalid="ignore"):  # inf * 0
        ours = _int8(qtype, raw, (45, 512))
        theirs = QuantWeight.from_raw("w", qtype, raw, (45, 512))
        assert not np.isfinite(ours.dequantize()[:3]).all()  # the case is not vacuous
        assert_bits_equal(ours.dequantize(), theirs.dequantize())
        assert_bits_equal(ours.rows(ids), theirs.rows(ids))


def test_weights_take_one_byte_and_scales_one_per_16():
    w = _int8(QType.Q6_K, quantized(QType.Q6_K, 64, 512), (64, 512))
    assert (w.tiles.q.dtype, w.tiles.q.nbytes) == (np.int8, 64 * 512)
    assert (w.tiles.s.dtype, w.tiles.s.nbytes) == (np.int8, 64 * 512 // 16)
    assert (w.tiles.d.dtype, w.tiles.d.nbytes) == (np.float32, 64 * 512 // 32 * 4)


# --- the emitted instructions ----------------------------------------------------------------


def test_integer_simd_in_assembly():
    """On AVX2 the half-block dots are vpmaddubsw, then vpmaddwd against the scales (with VNNI
    vpdpbusd, then vpmulld), with no reduction across lanes (no vphaddd)."""
    if "avx2" not in _cpu_flags() or not int8.AVX2:
        pytest.skip("no AVX2 in /proc/cpuinfo or on numba's target: portable IR is emitted")
    w = _int8(QType.Q6_K, quantized(QType.Q6_K, 16, 256), (16, 256))
    w.matmul(np.ones((1, 256), dtype=np.float32))
    kernel = int8_sub16.KERNEL
    fresh = numba.njit(parallel=True)(kernel.py_func)  # numba cannot inspect cached code
    sig = kernel.signatures[0]
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    ops = ("vpdpbusd", "vpmulld") if int8.ISA == int8.VNNI_DOT else ("vpmaddubsw", "vpmaddwd")
    for op in (*ops, "vpsignb"):
        assert op in asm, op
    assert "vphaddd" not in asm
