"""The integer matmul path (quant/int8.py): activation quantization against its definition, the
integer block dots exact, kernels bit for bit equal to their NumPy twins, batch invariance, an
error bound against float64, and the integer SIMD instructions in the emitted assembly."""

import re
from pathlib import Path

import numba
import numpy as np
import pytest
from quant_data import BLOCK_FORMATS, assert_bits_equal, edge_raw, quantized, reference

from cfr_atlas.errors import ConfigError
from cfr_atlas.quant import QType, QuantWeight, int8, int8_sub16, q4_0, q4_1, q8_0
from cfr_atlas.quant.tiles import TILE_ROWS, to_tiles
from cfr_atlas.quant.weight import CODECS, INT8_CODECS, INT8_FIELDS, INT8_SUB16

# the formats with their own integer path (the others keep their float codec under int8, tested
# below); EVERY_INT8 adds those of int8_fields.py and int8_sub16.py (test_quant_int8_fields.py
# and test_quant_int8_sub16.py test the rest)
INT8_FORMATS = {q: BLOCK_FORMATS[q] for q in (QType.Q8_0, QType.Q4_0, QType.Q4_1)}
EVERY_INT8 = [*INT8_FORMATS, *INT8_FIELDS, *INT8_SUB16]

KERNELS = {QType.Q8_0: q8_0._int_kernel, QType.Q4_0: q4_0._int_kernel,
           QType.Q4_1: q4_1._int_kernel}


def _int8(qtype, raw, shape) -> QuantWeight:
    return QuantWeight.from_raw("w", qtype, raw, shape, arithmetic="int8")


def _x(t: int, k: int, seed: int) -> np.ndarray:
    """Tokens with a wide dynamic range per token, exact zeros and negative zeros."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)) * 2.0 ** rng.integers(-12, 12, size=(t, 1))
    x[rng.random((t, k)) < 0.05] = 0.0
    x[rng.random((t, k)) < 0.05] = -0.0
    return x.astype(np.float32)


def _twin(w: QuantWeight, x: np.ndarray) -> np.ndarray:
    out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
    w.codec.matmul_numpy(x, w.tiles, out)
    return out


# --- activation quantization -----------------------------------------------------------------


def test_activation_block_by_hand():
    """amax 127 makes the scale 1, so q = rint(x): ties go to even; zero and inf blocks."""
    x = np.zeros((1, 96), dtype=np.float32)
    x[0, :6] = [127.0, 2.5, -3.5, 0.5, -0.4, 126.6]
    x[0, 64] = np.inf
    for xq, d, xsum in (int8.quantize(x), int8.quantize_numpy(x)):
        np.testing.assert_array_equal(xq[0, :6], [127, 2, -4, 0, 0, 127])
        assert not xq[0, 6:].any()
        np.testing.assert_array_equal(d[0, :2], [1.0, 0.0])
        assert np.isnan(d[0, 2])
        np.testing.assert_array_equal(xsum[0], [127 + 2 - 4 + 127, 0, 0])


def test_subnormal_scale_blocks_are_zero_blocks():
    """0 < amax < int8.TINY (127 / amax overflows to inf): q = 0 and xsum = 0 in the kernel and
    the twin alike, never an inf / NaN cast to int8 (undefined: the kernel gave xsum -4096)."""
    x = np.zeros((2, 64), dtype=np.float32)
    x[0, :3] = [1e-38, -5e-39, 3e-39]
    x[1, :2] = [int8.TINY, -int8.TINY]  # the smallest amax quantized as usual
    for xq, d, xsum in (int8.quantize(x), int8.quantize_numpy(x)):
        assert not xq[0].any() and not xsum[0].any()
        np.testing.assert_array_equal(d[0], [np.float32(1e-38) / np.float32(127), 0])
        np.testing.assert_array_equal(xq[1, :2], [127, -127])
    w = _int8(QType.Q4_1, quantized(QType.Q4_1, 40, 64), (40, 64))
    assert_bits_equal(w.matmul(x), _twin(w, x))


def test_activation_scale_and_range():
    x = _x(50, 256, seed=3)
    xq, d, xsum = int8.quantize(x)
    amax = np.abs(x.reshape(50, -1, 32)).max(axis=-1)
    np.testing.assert_array_equal(d, amax / np.float32(127.0))
    assert xq.min() >= -127 and xq.max() <= 127
    assert np.all(np.abs(xq).reshape(50, -1, 32).max(axis=-1)[amax > 0] == 127)
    np.testing.assert_array_equal(xsum, xq.reshape(50, -1, 32).sum(axis=-1))
    err = np.abs(x.reshape(50, -1, 32) - d[..., None] * xq.reshape(50, -1, 32))
    assert np.all(err <= d[..., None] * np.float32(0.5 + 1e-5))


@pytest.mark.parametrize("shape", [(1, 32), (7, 64), (33, 576), (128, 576)])
def test_activation_kernel_equals_twin(shape):
    """(128, 576) is past PARALLEL_ELEMENTS: the threads share the rows."""
    assert (shape[0] * shape[1] >= int8.PARALLEL_ELEMENTS) == (shape == (128, 576))
    x = _x(*shape, seed=shape[0])
    x[0, :3] = [1e-40, -1e-40, 3e38]
    for a, b in zip(int8.quantize(x), int8.quantize_numpy(x), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_activation_kernels_one_thread_or_two_alike():
    """The serial and the parallel kernel give the same bits at any size (quantize picks one
    by size alone)."""
    x = _x(9, 96, seed=4)
    x[1, :2] = [np.inf, 1e-40]
    outs = []
    for kernel in (int8.quantize_rows, int8._quantize_rows_parallel):
        xq = np.empty(x.shape, dtype=np.int8)
        xd = np.empty((9, 3), dtype=np.float32)
        xsum = np.empty((9, 3), dtype=np.int32)
        kernel(x, xq, xd, xsum)
        outs.append((xq, xd.view(np.uint32), xsum))
    for a, b in zip(*outs, strict=True):
        np.testing.assert_array_equal(a, b)


# --- kernels -------------------------------------------------------------------------------------


def _unit_block_raw(qtype: QType, q: np.ndarray) -> np.ndarray:
    """Raw blocks with scale 1 and minimum 0 holding q (stored values) -> (n, row_bytes)."""
    n, k = q.shape
    blocks = np.zeros((n, k // 32), dtype=INT8_FORMATS[qtype])
    blocks["d"] = 1.0
    qb = q.reshape(n, k // 32, 32)
    blocks["qs"] = qb if qtype is QType.Q8_0 else qb[..., :16] | (qb[..., 16:] << 4)
    return blocks.view(np.uint8).reshape(n, -1)


@pytest.mark.parametrize("qtype", list(INT8_FORMATS))
def test_block_dots_are_exact_integers(qtype):
    """Scale-1 weights and integer activations whose every block holds +-127 quantize to
    themselves, so each output is the exact integer dot: every lane of the 8-row dots and
    their cross-row sums lands on its own row."""
    rng = np.random.default_rng(5)
    n, k = 37, 128
    lo, hi = (-128, 128) if qtype is QType.Q8_0 else (0, 16)
    q = rng.integers(lo, hi, size=(n, k))
    q[:, ::32] = lo
    q[3], q[4] = lo, hi - 1  # the extreme rows: every int16 partial sum at its largest
    x = rng.integers(-127, 128, size=(5, k))
    x[:, 1::32] = 127
    x[3], x[4] = 127, -127
    w = _int8(qtype, _unit_block_raw(qtype, q.astype(np.uint8)), (n, k))
    vals = q - 8 if qtype is QType.Q4_0 else q
    expect = (x @ vals.T).astype(np.float32)
    y = w.matmul(x.astype(np.float32))
    np.testing.assert_array_equal(y, expect)
    np.testing.assert_array_equal(_twin(w, x.astype(np.float32)), expect)


@pytest.mark.parametrize("qtype", list(INT8_FORMATS))
@pytest.mark.parametrize("shape", [(1, 32), (17, 64), (70, 96)])
@pytest.mark.parametrize("t", [1, 2, 5, 7])
def test_kernel_equals_twin(qtype, shape, t):
    w = _int8(qtype, quantized(qtype, *shape, seed=t), shape)
    x = _x(t, shape[1], seed=shape[0])
    assert_bits_equal(w.matmul(x), _twin(w, x))


@pytest.mark.parametrize("qtype", EVERY_INT8)
def test_kernel_equals_twin_on_edge_blocks_and_non_finite(qtype):
    w = _int8(qtype, edge_raw(qtype, 45, 512, seed=4), (45, 512))
    x = _x(6, 512, seed=5)
    x[0, :5] = [0.0, -0.0, 1e-40, -1e-40, 3e38]
    x[1, 40], x[2, 100] = np.nan, -np.inf  # NaN rows where those blocks feed them
    y = w.matmul(x)
    np.testing.assert_array_equal(y, _twin(w, x))
    assert np.isnan(y[1]).all() and np.isnan(y[2]).all() and not np.isnan(y[3]).any()


@pytest.mark.parametrize("qtype", EVERY_INT8)
def test_rows_and_dequantize_read_the_int8_layout(qtype):
    raw = edge_raw(qtype, 45, 512, seed=8)
    w = _int8(qtype, raw, (45, 512))
    ref = reference(qtype, raw)
    assert_bits_equal(w.dequantize(), ref)
    ids = np.array([44, 0, 17, 16, 17])
    assert_bits_equal(w.rows(ids), ref[ids])


def test_float_formats_keep_their_float_codec():
    for qt in (QType.F32, QType.F16, QType.BF16):
        assert INT8_CODECS[qt] is CODECS[qt]
    with pytest.raises(ConfigError, match=r"matmul: 'int4' is not one of \['float', 'int8'\]"):
        QuantWeight.from_raw("w", QType.Q8_0, quantized(QType.Q8_0, 2, 32), (2, 32),
                             arithmetic="int4")


# --- batch invariance ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", EVERY_INT8)
@pytest.mark.parametrize("t", [1, 2, 3, 7, 64])
def test_rows_equal_matvec_chunks_and_threads(qtype, t):
    w = _int8(qtype, quantized(qtype, 100, 256, seed=t), (100, 256))
    x = _x(t, 256, seed=t + 1)
    y = w.matmul(x)
    for i in range(t):
        assert_bits_equal(y[i], w.matvec(x[i]))
    bounds = [0, *sorted({c for c in (1, 3, 4, 11) if c < t}), t]
    chunks = [w.matmul(x[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    assert_bits_equal(np.concatenate(chunks), y)
    before = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        assert_bits_equal(w.matmul(x, out=np.full_like(y, np.nan)), y)
    finally:
        numba.set_num_threads(before)


# --- accuracy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", EVERY_INT8)
def test_accuracy_against_float64(qtype):
    """|y - W x| <= sum_b (d_x,b / 2) sum_j |w_bj| (activation rounding, at most half a step
    per element) plus float32 rounding of the per-block terms; and the bound is not vacuous."""
    n, k = 64, 1536
    raw = quantized(qtype, n, k, seed=7)
    x = _x(3, k, seed=8)
    y = _int8(qtype, raw, (n, k)).matmul(x).astype(np.float64)
    w = reference(qtype, raw).astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    _, d, _ = int8.quantize_numpy(x)
    wabs = np.abs(w).reshape(n, -1, 32).sum(axis=-1)  # (n, nb)
    act = 0.5 * (1 + 1e-6) * d.astype(np.float64) @ wabs.T
    rounding = (k // 32 + 4) * 2.0**-24 * (np.abs(x).astype(np.float64) @ np.abs(w).T) * 2
    err = np.abs(y - exact)
    assert np.all(err <= act + rounding)
    assert np.median(err / (act + rounding)) < 0.2


# --- the emitted instructions ----------------------------------------------------------------


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    line = re.search(r"^flags\s*:(.*)$", text, re.M)
    return set(line.group(1).split()) if line else set()


def simd_ops() -> tuple[str, ...]:
    """The instructions a block dot is built of on this machine's best dot (int8.ISA)."""
    return ("vpdpbusd",) if int8.ISA == int8.VNNI_DOT else ("vpmaddubsw", "vpmaddwd")


@pytest.mark.parametrize("qtype", list(INT8_FORMATS))
def test_integer_simd_in_assembly(qtype):
    """On AVX2 the block dots are vpmaddubsw + vpmaddwd, on a machine with AVX-512 VNNI or
    AVX-VNNI one vpdpbusd a chunk; elsewhere nothing to look for."""
    if "avx2" not in _cpu_flags() or not int8.AVX2:
        pytest.skip("no AVX2 in /proc/cpuinfo or on numba's target: portable IR is emitted")
    w = _int8(qtype, quantized(qtype, 16, 64), (16, 64))
    w.matmul(np.ones((1, 64), dtype=np.float32))
    # numba cannot inspect code loaded from its cache: compile the same function afresh
    kernel = KERNELS[qtype]
    fresh = numba.njit(parallel=True)(kernel.py_func)
    sig = kernel.signatures[0]
    fresh.compile(sig)
    asm = fresh.inspect_asm(sig)
    for op in simd_ops():
        assert re.search(rf"\b{op}\b", asm), op
    assert not re.search(r"\bvphaddd\b", asm)  # rows line up in lanes: no horizontal adds
    if int8.WIDE:  # passes of four and eight tokens: 16 rows a vector, 512-bit registers
        assert re.search(r"\bvpdpbusd\b[^\n]*zmm", asm)
    if int8.ISA == int8.VNNI_DOT:  # int8 weights read unsigned as stored: no sign handling
        assert not re.search(r"\bvpsignb\b", asm)


def test_vnni_is_used_where_the_cpu_has_it():
    """A CPU reporting avx512_vnni (with avx512vl) or avx_vnni gets the vpdpbusd dots."""
    flags = _cpu_flags()
    has = ("avx512_vnni" in flags and "avx512vl" in flags) or "avx_vnni" in flags
    if "avx2" not in flags or numba.config.CPU_NAME:
        pytest.skip("no AVX2, or numba's target is set by NUMBA_CPU_NAME")
    assert int8.VNNI == has and (int8.ISA == int8.VNNI_DOT) == has


@pytest.mark.parametrize("bits, term", [(8, int8.SCALE), (8, int8.MIN), (4, int8.MIN),
                                        (4, int8.OFFSET8), (5, int8.OFFSET16), (5, int8.MIN)])
def test_every_dot_and_kernel_gives_the_same_bits(bits, term):
    """The portable IR (machines without AVX2), the AVX2 intrinsics and vpdpbusd (where the
    machine has VNNI), each in both kernels (sums in registers, dots and sums in memory), give
    the same bits on any weight bytes, including int8 -128 and 127, every nibble 15 and every
    5-bit weight 31; int8 on vpdpbusd reads the stored bytes unsigned and takes 128 xsum off
    in the term, the others flip them back first. Token counts cover fours, a pair, one, and
    fours then a pair then one, and for the wide register kernel (16 rows a vector, where the
    target has AVX-512 BW and VNNI) eights, then four, a pair and one in every combination
    (8-15 tokens)."""
    rng = np.random.default_rng(11)
    n, k, unit = 70, 256, int8.UNIT[bits]
    q = rng.integers(0, 256, size=(n, k // 32 * unit)).astype(np.uint8)
    q[:3] = {8: 0x00, 4: 0xFF, 5: 0xFF}[bits]  # int8: stored 0x00 is -128 (sign-flipped)
    q[3:5] = {8: 0xFF, 4: 0x00, 5: 0x00}[bits]  # int8: 127
    tiles = int8.to_block_tiles(q, unit)
    d = to_tiles(rng.random((n, k // 32)).astype(np.float32))
    m = to_tiles(rng.standard_normal((n, k // 32)).astype(np.float32))
    kernels = [int8.tile_kernel(bits, term, isa=isa, in_registers=regs, rows=int8.GROUP)
               for isa in int8.ISAS for regs in (True, False)]
    if int8.WIDE:  # 16 rows a vector, tokens in eights
        kernels.append(int8.tile_kernel(bits, term, isa=int8.VNNI_DOT, rows=int8.WIDE_ROWS))
    for t in (1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 30):
        xq, xd, xsum = int8.quantize(_x(t, k, seed=t))
        got = [np.empty((t, n), dtype=np.float32) for _ in kernels]
        for kernel, out in zip(kernels, got, strict=True):
            kernel(xq, xd, xsum, tiles, d, m, out)
        for other in got[1:]:
            assert_bits_equal(got[0], other)


def test_register_sums_with_vnni_on_32_vector_registers():
    """The kernel keeps its sums in registers for vpdpbusd dots on a target with AVX-512's 32
    vector registers, else the memory kernel (which ran faster with 16 registers, and for
    int8 weights with AVX2's dots: int8.REGISTER_SUMS); Q6_K / Q3_K follow the same rule.
    With AVX-512 BW too (int8.WIDE) the block tiles' register passes take 16 rows a vector;
    Q6_K / Q3_K's dots stay 8 rows a vector."""
    assert int8.REGISTER_SUMS == (int8.VNNI and int8._target_has("avx512f", "avx512vnni",
                                                                  "avx512vl"))
    assert int8.WIDE == (int8.REGISTER_SUMS and int8._target_has("avx512bw"))

    def kind(kernel):
        return kernel.py_func.__qualname__.split(".")[0]

    for isa in int8.ISAS:
        registers = int8.REGISTER_SUMS and isa == int8.VNNI_DOT
        want = "_register_kernel" if registers else "_memory_kernel"
        wide = "_wide_kernel" if registers and int8.WIDE else want
        for bits in int8.UNIT:
            assert kind(int8.tile_kernel(bits, int8.OFFSET8, isa=isa)) == wide
            assert int8.pass_rows(bits, isa) == (int8.WIDE_ROWS if wide == "_wide_kernel"
                                                 else int8.GROUP)
        assert kind(int8_sub16.tile_kernel(isa=isa)) == want
        assert int8.pass_rows(int8.SUB16, isa) == int8.GROUP


def test_a_wide_kernel_is_refused_where_it_cannot_run():
    """16 rows a vector need 512-bit vpdpbusd: asking for them off a WIDE target, or with
    another ISA's dots, or for any other row count, is a ValueError when the kernel is built
    (LLVM would abort the process compiling a 512-bit dot for a target without AVX-512)."""
    for isa in int8.ISAS:
        if not (int8.WIDE and isa == int8.VNNI_DOT):
            with pytest.raises(ValueError, match="rows 16"):
                int8.tile_kernel(4, int8.OFFSET8, isa=isa, in_registers=True,
                                 rows=int8.WIDE_ROWS)
    with pytest.raises(ValueError, match="rows 12"):
        int8.tile_kernel(4, int8.OFFSET8, rows=12)


@pytest.mark.parametrize("bits, term", [(8, int8.SCALE), (4, int8.OFFSET8), (4, int8.MIN),
                                        (5, int8.OFFSET16)])
def test_float16_scales_are_their_float32_values(bits, term):
    """Scales and offsets kept as float16 bits (the block formats' own GGUF values) give
    bitwise the kernel's result with the same values widened to float32 up front, subnormal,
    inf and NaN scales included: the term widens them exactly, before the same operations.
    15 tokens: a pass of eight, four, a pair and one (on a WIDE target the first two with 16
    rows a vector, whose scales load 16 at a time)."""
    rng = np.random.default_rng(5)
    n, k, unit = 40, 128, int8.UNIT[bits]
    q = rng.integers(0, 256, size=(n, k // 32 * unit)).astype(np.uint8)
    d16 = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    m16 = rng.standard_normal((n, k // 32)).astype(np.float16)
    d16[0, :4] = [np.float16(6e-8), np.float16(65504), np.float16(np.inf), np.float16(np.nan)]
    m16[1, :2] = [np.float16(-6e-8), np.float16(-np.inf)]
    tiles = int8.to_block_tiles(q, unit)
    kernel = int8.tile_kernel(bits, term)
    xq, xd, xsum = int8.quantize(_x(15, k, seed=2))
    got = np.empty((15, n), dtype=np.float32)
    want = np.empty((15, n), dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        kernel(xq, xd, xsum, tiles, to_tiles(d16.view(np.uint16)), to_tiles(m16.view(np.uint16)),
               got)
        kernel(xq, xd, xsum, tiles, to_tiles(d16.astype(np.float32)),
               to_tiles(m16.astype(np.float32)), want)
    assert_bits_equal(got, want)
    assert np.isnan(got[:, 0]).all() and np.isfinite(got[:, 2:]).all()


@pytest.mark.parametrize("qtype", list(INT8_FORMATS))
def test_tiles_stream_the_bytes_gguf_stores(qtype):
    """Q8_0, Q4_0 and Q4_1 keep their quants at their width and their float16 scales as
    float16: a matrix's integer tiles are exactly as many bytes as its GGUF blocks."""
    rows, k = 4 * TILE_ROWS, 256
    raw = quantized(qtype, rows, k)
    w = _int8(qtype, raw, (rows, k))
    assert sum(a.nbytes for a in w.tiles) == raw.nbytes
    assert all(a.dtype == np.uint16 for a in w.tiles[1:])  # float16 bits


def test_five_bit_dots_are_exact_at_the_int16_bound():
    """5-bit weights at scale 1 against integer activations: each output is the exact integer
    dot of the stored values, also where every weight is 31 and every activation +-127 (each
    half's int16 sum at its largest on AVX2, 4 * 2 * 31 * 127 = 31,496), on every dot."""
    rng = np.random.default_rng(3)
    n, k = 37, 128
    q = rng.integers(0, 32, size=(n, k)).astype(np.uint8)
    q[3], q[4] = 31, 0
    x = rng.integers(-127, 128, size=(5, k))
    x[:, ::32] = 127  # every block's scale 1: the activations quantize to themselves
    x[3], x[4] = 127, -127
    tiles = int8.to_block_tiles(int8.pack_five(q), int8.UNIT[5])
    ones = to_tiles(np.ones((n, k // 32), dtype=np.float32))
    expect = (x @ q.astype(np.int64).T).astype(np.float32)
    xq, xd, xsum = int8.quantize(x.astype(np.float32))
    np.testing.assert_array_equal(xq, x)
    for isa in int8.ISAS:
        for regs in (True, False):
            out = np.empty((5, n), dtype=np.float32)
            int8.tile_kernel(5, int8.SCALE, isa=isa, in_registers=regs)(xq, xd, xsum, tiles,
                                                                          ones, ones, out)
            np.testing.assert_array_equal(out, expect)


def test_five_bit_packing_by_its_definition():
    """pack_five: per block the nibbles of q & 15 as pack_nibbles, then byte i with
    q[4c + i] >> 4 at bit 2c and q[16 + 4c + i] >> 4 at bit 2c + 1; unpack_five inverts it."""
    rng = np.random.default_rng(4)
    q = rng.integers(0, 32, size=(6, 96)).astype(np.uint8)
    packed = int8.pack_five(q)
    assert packed.shape == (6, 3 * 20)
    for r in range(6):
        for b in range(3):
            blk, p = q[r, b * 32:(b + 1) * 32], packed[r, b * 20:(b + 1) * 20]
            assert_array_same(p[:16], int8.pack_nibbles((blk & 15)[None])[0])
            for i in range(4):
                expect = sum(int(blk[4 * c + i] >> 4) << (2 * c)
                             | int(blk[16 + 4 * c + i] >> 4) << (2 * c + 1) for c in range(4))
                assert p[16 + i] == expect
    assert_array_same(int8.unpack_five(packed), q)


@pytest.mark.parametrize("nbytes", [16, 20, 32])
def test_block_tile_layout(nbytes):
    """to_block_tiles puts byte j of row r, block b at b * TILE_ROWS * nbytes +
    block_byte(r, j, nbytes) of its tile; gather_block_rows reads any rows back."""
    assert [int8.block_byte(r, j, nbytes) for r, j in ((0, 0), (1, 0), (0, 4), (8, 0))] \
        == [0, 4, 32, 8 * nbytes]
    rng = np.random.default_rng(nbytes)
    n, nb = 70, 3
    a = rng.integers(1, 256, size=(n, nb * nbytes)).astype(np.uint8)
    tiles = int8.to_block_tiles(a, nbytes)
    assert tiles.shape == (-(-n // TILE_ROWS), nb * TILE_ROWS * nbytes)
    for row in (0, 7, 8, TILE_ROWS - 1, TILE_ROWS, n - 1):
        i, r = divmod(row, TILE_ROWS)
        for b in range(nb):
            for j in range(nbytes):
                at = b * TILE_ROWS * nbytes + int8.block_byte(r, j, nbytes)
                assert tiles[i, at] == a[row, b * nbytes + j]
    rows = int8.gather_block_rows(tiles, slice(None), nbytes)
    assert_array_same(rows[:n], a)
    assert not rows[n:].any()  # the padding rows
    ids = np.array([69, 0, 33, 8, 8])
    assert_array_same(int8.gather_block_rows(tiles, ids, nbytes), a[ids])
    assert int8.gather_block_rows(tiles, np.array([], dtype=np.int64), nbytes).shape \
        == (0, nb * nbytes)


# --- load-time layouts -------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 15, 16, 17, 32, 33, 100])
def test_nibble_tiles_equal_unpack_then_tile(n):
    """The float path's one-pass nibble repack == unpack, then to_tiles (Q4_1 and Q4_0)."""
    raw = edge_raw(QType.Q4_1, n, 96, seed=n)
    assert_array_same(q4_1.repack(raw).q, to_tiles(q4_1._fields(raw)[2].astype(np.int8)))
    raw = edge_raw(QType.Q4_0, n, 96, seed=n)
    assert_array_same(q4_0.repack(raw).q, to_tiles(q4_0._fields(raw)[1]))


def assert_array_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)


def test_integer_kernels_load_from_numba_cache_in_a_new_process():
    """Every integer-path kernel is compiled once, then loaded from numba's disk cache by later
    processes. (A kernel whose closure held an intrinsic or dispatcher object got a new cache
    key in every process and was compiled anew by each: ~3 s of every int8 start.)"""
    import subprocess
    import sys

    code = """
import numpy as np
from cfr_atlas.quant import int8, int8_fields, int8_sub16, q4_0, q4_1, q8_0
xq, xd, xsum = int8.quantize(np.ones((1, 64), dtype=np.float32))
q = np.zeros((1, 2 * 32 * 32), dtype=np.uint8)
d = np.zeros((1, 2 * 32), dtype=np.float32)
out = np.empty((1, 32), dtype=np.float32)
kernels = [q4_0._int_kernel, q4_1._int_kernel, q8_0._int_kernel,
           *int8_fields._KERNELS.values()]
for k in kernels:
    k(xq, xd, xsum, q, d, d, out)
int8_sub16.KERNEL(xq, xd, xsum, q.view(np.int8), d, np.zeros((1, 2 * 64), dtype=np.int8), out)
kernels.append(int8_sub16.KERNEL)
print(sum(k.stats.cache_misses.get(s, 0) for k in kernels for s in k.signatures))
"""
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, timeout=600) for _ in range(2)]
    assert runs[1].stdout.strip() == "0", runs[1].stderr[-2000:]


def test_activation_blocks_as_vectors_are_the_plain_loops():
    """`_quantize_row`'s vector blocks (`_block_max_bits`, `_block_quantize`) against the plain
    loops they replace and the twin, bit for bit: values whose scaled
    magnitudes land on ties (x * 127 / amax = k + 1/2), signed zeros, NaN, infinities,
    subnormal and huge blocks, and rows read through a stride (the element-by-element load)."""
    from numba import njit

    @njit
    def loops(x, xq, xd, xsum):  # the plain loops the vector blocks replaced
        for t in range(x.shape[0]):
            for b in range(x.shape[1] // 32):
                k0 = b * 32
                m = np.int32(0)
                for j in range(32):
                    m = max(m, int8._f32_bits(x[t, k0 + j]) & int8._ABS_BITS)
                if m > int8._MAX_BITS:
                    xd[t, b] = np.float32(np.nan)
                    xq[t, k0:k0 + 32] = 0
                    xsum[t, b] = 0
                    continue
                amax = int8._f32_from_bits(m)
                inv = int8.QMAX / amax if amax >= int8.TINY else np.float32(0.0)
                s = np.int32(0)
                for j in range(32):
                    q = np.int8(np.rint(x[t, k0 + j] * inv))
                    xq[t, k0 + j] = q
                    s += np.int32(q)
                xd[t, b] = amax / int8.QMAX
                xsum[t, b] = s

    rng = np.random.default_rng(12)
    x = rng.standard_normal((40, 256)).astype(np.float32) * rng.choice(
        [1e-30, 1e-3, 1.0, 1e3, 3e37], (40, 1)).astype(np.float32)
    x[0, :32] = np.arange(-16, 16, dtype=np.float32) * np.float32(0.5)  # 8: amax, ties at .5
    x[0, 32:64] = (np.arange(32, dtype=np.float32) - np.float32(15.5)) / np.float32(15.5) \
        * np.float32(127.0)
    x[1, :3] = [-0.0, 0.0, -0.0]
    x[1, 32:35] = [np.nan, 1.0, 2.0]
    x[1, 64:67] = [-np.inf, 1.0, 2.0]
    x[1, 96:99] = [1e-40, -3e-41, 0.0]
    x[2, :] = np.finfo(np.float32).max * np.where(np.arange(256) % 2, -1, 1)
    for rows in (x, np.repeat(x, 2, axis=1)[:, ::2]):  # contiguous, then strided rows
        assert np.array_equal(rows, x, equal_nan=True) and rows.flags.c_contiguous == (rows is x)
        outs = []
        for kernel in (int8.quantize_rows, loops):
            xq = np.empty(x.shape, dtype=np.int8)
            xd = np.empty((40, 8), dtype=np.float32)
            xsum = np.empty((40, 8), dtype=np.int32)
            kernel(rows, xq, xd, xsum)
            outs.append((xq, xd.view(np.uint32), xsum))
        twin = int8.quantize_numpy(x)
        outs.append((twin[0], twin[1].view(np.uint32), twin[2]))
        for a, b, c in zip(*outs, strict=True):
            np.testing.assert_array_equal(a, b)
            np.testing.assert_array_equal(a, c)


def test_transient_quantization_is_quantize_in_reused_buffers():
    """`quantize_transient` gives `quantize`'s bits, into buffers the calling thread reuses for
    the next call of the same shape (another shape, or another thread, gets its own), so the
    integer products quantize without allocating; the shapes kept stay bounded."""
    import threading

    x = _x(3, 64, seed=4)
    first = int8.quantize_transient(x)
    for got, want in zip(first, int8.quantize(x), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
    y = _x(3, 64, seed=5)
    again = int8.quantize_transient(y)
    assert all(a is b for a, b in zip(first, again, strict=True))  # the same buffers, refilled
    for got, want in zip(again, int8.quantize(y), strict=True):
        assert got.dtype == want.dtype and np.array_equal(got, want, equal_nan=True)
    other = int8.quantize_transient(_x(2, 64, seed=6))
    assert other[0] is not first[0] and other[0].shape == (2, 64)
    seen = []
    t = threading.Thread(target=lambda: seen.append(int8.quantize_transient(y)))
    t.start()
    t.join()
    assert seen[0][0] is not first[0]  # another thread's own buffers
    assert np.array_equal(seen[0][0], first[0])
    for rows in range(1, 2 * int8.SCRATCH_SHAPES + 2):
        int8.quantize_transient(_x(rows, 32, seed=rows))
    assert len(int8._scratch.bufs) <= int8.SCRATCH_SHAPES
