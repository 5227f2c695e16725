"""QuantWeight: one weight matrix in any supported format behind matvec / matmul / dequantize /
rows, so the model never branches on the format.

Holds the boundary checks (typed errors carrying the numbers) and the codec tables by QType, one
per arithmetic ("float": float32 activations; "int8": activations quantized per block, integer
block dots, see int8.py; formats without an integer path use their float codec); the
arithmetic lives in the format modules and trusts what this module passes on. Not here: reading
GGUF files (models/ does), quantizing, BLAS.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import ConfigError, DimensionError
from cfr_atlas.quant import floats, int8, int8_fields, int8_sub16, kquants, q4_0, q4_1, q5, q8_0
from cfr_atlas.quant.formats import Codec, QType, qtype_from_gguf, row_bytes
from cfr_atlas.quant.int8_fields import Width
from cfr_atlas.quant.subblock import Offset

CODECS: dict[QType, Codec] = {
    c.qtype: c
    for c in (q8_0.CODEC, q4_0.CODEC, q4_1.CODEC, *q5.CODECS, *kquants.CODECS, *floats.CODECS)
}
# the sub-block formats whose sub-block is the activation block of 32 (int8_fields.py): fields,
# offset, how the quants are kept (int8_fields.Width: 8 bits, 4 packed two to a byte, or 5), and
# whether the scales are GGUF's float16 values (kept as float16)
INT8_FIELDS = {QType.Q5_0: (q5.q5_0_fields, Offset.NONE, Width(5, bias=16), True),
               QType.Q5_1: (q5.q5_1_fields, Offset.ADD, Width(5), True),
               QType.IQ4_NL: (q5.iq4_nl_fields, Offset.NONE, Width(8), True),
               QType.Q4_K: (kquants.q4_k_fields, Offset.SUBTRACT, Width(4), False),
               QType.Q5_K: (kquants.q5_k_fields, Offset.SUBTRACT, Width(5), False)}
# the K-quants with sub-blocks of 16 and no offset (int8_sub16.py: two scaled half-block dots
# per activation block): their unpacker into d, sc, q. Q2_K (an offset per 16) keeps its float
# codec under int8
INT8_SUB16 = {QType.Q6_K: kquants.q6_k_scaled, QType.Q3_K: kquants.q3_k_scaled}
INT8_CODECS: dict[QType, Codec] = {
    **CODECS,
    **{c.qtype: c for c in (q8_0.INT8, q4_0.INT8, q4_1.INT8)},
    **{qt: int8_fields.codec(qt, f, off, CODECS[qt].dequantize, width, half)
       for qt, (f, off, width, half) in INT8_FIELDS.items()},
    **{qt: int8_sub16.codec(qt, split, CODECS[qt].dequantize)
       for qt, split in INT8_SUB16.items()},
}
ARITHMETIC: dict[str, dict[QType, Codec]] = {"float": CODECS, "int8": INT8_CODECS}


def check_arithmetic(arithmetic: str) -> str:
    """The name if it is a key of ARITHMETIC, else ConfigError naming the choices."""
    if arithmetic not in ARITHMETIC:
        raise ConfigError("matmul", f"{arithmetic!r} is not one of {sorted(ARITHMETIC)}")
    return arithmetic


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        order = "" if a.flags.c_contiguous else " non-contiguous"
        return f"{a.dtype}{order} {a.shape}"
    return type(a).__name__


@dataclass(frozen=True, eq=False, repr=False)
class QuantWeight:
    """A (N, K) matrix W held in its quantized form, repacked into row tiles at load time.

    y = W @ x for x (K,) and Y = X @ W.T for X (T, K). Every output element is reduced in one
    fixed order (tiles.py), so matmul(X)[t] == matvec(X[t]) == matmul(X[a:b])[t - a] bitwise.
    """

    name: str
    qtype: QType
    shape: tuple[int, int]  # (N output rows, K input columns)
    tiles: tuple  # the codec's Tiles
    codec: Codec  # the format's codec for the chosen arithmetic

    @classmethod
    def from_raw(cls, name: str, qtype, raw: np.ndarray, shape: tuple[int, int], *,
                 arithmetic: str = "float", repack=None) -> QuantWeight:
        """Repack raw GGUF data: (N, row_bytes) uint8 for block formats, (N, K) float32/float16
        for F32/F16 (uint8 also accepted). qtype is a QType or a gguf.GGMLQuantizationType;
        arithmetic "float" or "int8" (ARITHMETIC) picks the codec and so the tile layout.
        repack: (name, codec, rows) -> tiles, standing in for codec.repack(rows) (a tile
        cache, models/tile_cache.py, whose tiles are bitwise the repacked ones)."""
        table = ARITHMETIC[check_arithmetic(arithmetic)]
        qtype = qtype_from_gguf(qtype, name)
        try:
            n, k = (int(s) for s in shape)
        except (TypeError, ValueError):
            raise DimensionError(f"{name}: shape must be (N, K), got {shape!r}") from None
        codec = table[qtype]
        raw = np.asarray(raw)
        allowed = {np.dtype(np.uint8), codec.raw_dtype}
        if raw.dtype not in allowed:
            names = " or ".join(sorted(str(a) for a in allowed))
            raise DimensionError(f"{name}: {qtype.name} data must be {names}, got {raw.dtype}")
        if n <= 0:
            raise DimensionError(f"{name}: need at least one row, got shape ({n}, {k})")
        try:
            need = n * row_bytes(qtype, k)
        except DimensionError as e:
            raise DimensionError(f"{name}: {e}") from None
        if raw.nbytes != need:
            raise DimensionError(
                f"{name}: {raw.nbytes} bytes of {qtype.name} data, but shape ({n}, {k}) needs "
                f"{need}"
            )
        rows = np.ascontiguousarray(raw).view(np.uint8).reshape(n, -1)
        tiles = codec.repack(rows) if repack is None else repack(name, codec, rows)
        return cls(name, qtype, (n, k), tiles, codec)

    from_gguf = from_raw  # the name loaders use: (name, tensor.tensor_type, tensor.data, (N, K))

    @property
    def nbytes(self) -> int:
        """Bytes held by the repacked tiles."""
        return sum(a.nbytes for a in self.tiles if isinstance(a, np.ndarray))

    def matvec(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x: (K,) float32 -> (N,) float32, W @ x."""
        n, k = self.shape
        self._check("x", x, (k,))
        out = self._output(out, (n,))
        self.codec.matmul(x.reshape(1, k), self.tiles, out.reshape(1, n))
        return out

    def matmul(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """x: (T, K) float32 -> (T, N) float32, x @ W.T; row t equals matvec(x[t]) bitwise."""
        out = self._output(out, (self._rows_of(x), self.shape[0]))
        self.codec.matmul(x, self.tiles, out)
        return out

    def product(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        """`matmul` into out, with the checks of a caller whose rows are float32 and
        C-contiguous by construction (the decode step's buffers): the shapes only."""
        n, k = self.shape
        if x.shape[1:] != (k,) or out.shape != (x.shape[0], n):
            raise DimensionError(f"{self.name}: x {x.shape} and out {out.shape} must be "
                                 f"(T, {k}) and (T, {n})")
        self.codec.matmul(x, self.tiles, out)
        return out

    @property
    def integer(self) -> bool:
        """True when products take the integer path (int8 activations, int8.py): the int8
        arithmetic and a format that has one."""
        return self.codec is not CODECS[self.qtype]

    REFINE_ROWS = 32  # matmul_refined's rows per pass (Gemma 3's head: 64 MiB of scratch)

    def matmul_refined(self, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """matmul, with activations to ~15 bits on the integer path: x and its quantization
        residual (int8.with_residual) go through the kernel as one batch of twice the rows
        (REFINE_ROWS rows of x at a time), the weights streamed once for both, and
        out[t] = y[2t] + y[2t + 1]. Row t depends on x[t] only.
        Same as matmul off the integer path. For the output head, where 8-bit activations
        cost argmax agreement (docs/CONFORMANCE.md)."""
        if not self.integer:
            return self.matmul(x, out)
        T, n = self._rows_of(x), self.shape[0]
        out = self._output(out, (T, n))
        step = self.REFINE_ROWS  # rows per pass: the (2 x step, N) scratch stays bounded
        pair = np.empty((2 * min(T, step), n), dtype=np.float32)
        for a in range(0, T, step):
            rows = x[a:a + step]
            y = pair[:2 * len(rows)]
            self.codec.matmul(int8.with_residual(rows), self.tiles, y)
            np.add(y[0::2], y[1::2], out=out[a:a + len(rows)])
        return out

    def rows(self, ids, out: np.ndarray | None = None) -> np.ndarray:
        """ids: (n,) integer row ids -> (n, K) float32 rows of W (an embedding lookup); only the
        requested rows are dequantized, each equal to the same row of dequantize()."""
        n_rows, k = self.shape
        ids = np.asarray(ids)
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise DimensionError(f"{self.name}: ids must be 1-D integers, got {_describe(ids)}")
        bad = ids[(ids < 0) | (ids >= n_rows)]
        if bad.size:
            raise DimensionError(f"{self.name}: row id {bad[0]} out of range for {n_rows} rows")
        if out is not None:
            self._check("out", out, (ids.shape[0], k))
        return self.codec.unpack_rows(self.tiles, ids, out)

    def dequantize(self, out: np.ndarray | None = None) -> np.ndarray:
        """-> (N, K) float32, bitwise equal to gguf.quants.dequantize of the raw data."""
        if out is not None:
            self._check("out", out, self.shape)
        return self.codec.unpack_rows(self.tiles, slice(0, self.shape[0]), out)

    def _rows_of(self, x) -> int:
        """T of a valid x (T, K) float32 C-contiguous, else DimensionError."""
        k = self.shape[1]
        if not isinstance(x, np.ndarray) or x.ndim != 2:
            raise DimensionError(f"{self.name}: x must be float32 (T, {k}), got {_describe(x)}")
        self._check("x", x, (x.shape[0], k))
        return x.shape[0]

    def _check(self, what: str, a, shape: tuple[int, ...]) -> None:
        if (not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.shape != shape
                or not a.flags.c_contiguous):
            raise DimensionError(
                f"{self.name}: {what} must be C-contiguous float32 {shape}, got {_describe(a)}"
            )

    def _output(self, out: np.ndarray | None, shape: tuple[int, ...]) -> np.ndarray:
        if out is None:
            return np.empty(shape, dtype=np.float32)
        self._check("out", out, shape)
        return out

    def __repr__(self) -> str:
        n, k = self.shape
        return f"QuantWeight({self.name!r}, {self.qtype.name}, ({n}, {k}), {self.nbytes} bytes)"
