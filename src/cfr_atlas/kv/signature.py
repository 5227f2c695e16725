"""What makes stored K/V reusable: the cache signature, the block layout, and `KvBlock`.

`CacheSignature` lists every fact besides the tokens that decides the bytes of a K/V block:
the model (content identity, architecture, geometry), the storage dtype, the block size, the
RoPE convention and the sliding window, `format_version`, bumped whenever the engine's
K/V arithmetic changes (a kernel that rounds differently makes old blocks wrong, not corrupt),
and the build that computed the rows: `package_version` (cfr-atlas) and `kernel_build`
(kv/build.py: Python, NumPy, numba, llvmlite, target CPU). Both default to this process's.
Two blocks may be exchanged only when their signatures are equal; `first_mismatch` names the
first field that differs. `to_bytes()` is versioned and `from_bytes()` refuses anything but an
exact, complete encoding of this version:

    magic b"CSIG" | version u16 | model_id str | architecture str | n_layers u32 |
    n_kv_heads u32 | head_dim u32 | storage_dtype str | block_tokens u32 | rope_theta f64 |
    rope_mode str | sliding_window u32 (0 = none) | format_version u32 |
    package_version str | kernel_build str
    (str = u16 length + UTF-8; everything little-endian)

A block size must divide a sliding window, so a window boundary never cuts a block.
This module holds values and checks only: no hashing, no files.
"""

from __future__ import annotations

import dataclasses
import math
import struct
from dataclasses import dataclass, field

import numpy as np

from cfr_atlas.atlas.storage import StorageDtype
from cfr_atlas.errors import BlockLayoutError, ConfigError, CorruptBlockError, DimensionError
from cfr_atlas.kv import build

SIG_MAGIC, SIG_VERSION = b"CSIG", 2
KV_FORMAT_VERSION = 1  # bump when the engine's K/V arithmetic changes
_U32_MAX = (1 << 32) - 1


def aligned_block_size(window: int, desired: int) -> int:
    """The largest divisor of `window` that is not above `desired` (at least 1)."""
    for name, value in (("window", window), ("desired", desired)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise BlockLayoutError(f"{name} must be a positive integer, got {value!r}")
    return next(b for b in range(min(window, desired), 0, -1) if window % b == 0)


@dataclass(frozen=True)
class BlockLayout:
    """Block size and sliding window (None = full attention); the block must divide the window."""

    block_tokens: int
    window: int | None = None

    def __post_init__(self):
        if isinstance(self.block_tokens, bool) or not isinstance(self.block_tokens, int) \
                or self.block_tokens < 1:
            raise BlockLayoutError(f"block_tokens must be a positive integer, "
                                   f"got {self.block_tokens!r}")
        if self.window is None:
            return
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise BlockLayoutError(f"sliding window must be a positive integer or None, "
                                   f"got {self.window!r}")
        if self.window % self.block_tokens:
            raise BlockLayoutError(
                f"block_tokens {self.block_tokens} does not divide the sliding window "
                f"{self.window}; use aligned_block_size({self.window}, {self.block_tokens}) = "
                f"{aligned_block_size(self.window, self.block_tokens)}")


@dataclass(frozen=True)
class CacheSignature:
    """Everything besides token ids that decides a K/V block's bytes (see module docstring)."""

    model_id: str
    architecture: str
    n_layers: int
    n_kv_heads: int
    head_dim: int
    storage_dtype: str
    block_tokens: int
    rope_theta: float
    rope_mode: str
    sliding_window: int | None = None
    format_version: int = KV_FORMAT_VERSION
    package_version: str = field(default_factory=lambda: build.package_version())
    kernel_build: str = field(default_factory=lambda: build.kernel_fingerprint())

    def __post_init__(self):
        for name in ("model_id", "architecture", "storage_dtype", "rope_mode", "package_version",
                     "kernel_build"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value.encode()) > 0xFFFF:
                raise ConfigError(name, f"must be a non-empty string, got {value!r}")
        for name in ("n_layers", "n_kv_heads", "head_dim", "block_tokens", "format_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= _U32_MAX:
                raise ConfigError(name, f"must be an integer in [1, 2**32), got {value!r}")
        try:
            StorageDtype(self.storage_dtype)
        except ValueError:
            raise ConfigError("storage_dtype", "must be float32, float16 or bfloat16, "
                                               f"got {self.storage_dtype!r}") from None
        theta = self.rope_theta
        if isinstance(theta, bool) or not isinstance(theta, int | float) \
                or not math.isfinite(theta) or theta <= 0:
            raise ConfigError("rope_theta", f"must be a finite positive number, got {theta!r}")
        object.__setattr__(self, "rope_theta", float(theta))
        BlockLayout(self.block_tokens, self.sliding_window)
        if self.sliding_window is not None and self.sliding_window > _U32_MAX:
            raise ConfigError("sliding_window", f"must be below 2**32, got {self.sliding_window}")

    @property
    def dtype(self) -> StorageDtype:
        return StorageDtype(self.storage_dtype)

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """Shape of a block's K (and V): (n_layers, n_kv_heads, block_tokens, head_dim)."""
        return (self.n_layers, self.n_kv_heads, self.block_tokens, self.head_dim)

    @property
    def block_kv_bytes(self) -> int:
        """Bytes of one block's K + V rows."""
        return 2 * math.prod(self.block_shape) * self.dtype.itemsize

    def first_mismatch(self, other: CacheSignature) -> str | None:
        """The name of the first field (in declaration order) that differs, or None."""
        for f in dataclasses.fields(self):
            if getattr(self, f.name) != getattr(other, f.name):
                return f.name
        return None

    def to_bytes(self) -> bytes:
        parts = [struct.pack("<4sH", SIG_MAGIC, SIG_VERSION), _str(self.model_id),
                 _str(self.architecture),
                 struct.pack("<III", self.n_layers, self.n_kv_heads, self.head_dim),
                 _str(self.storage_dtype), struct.pack("<Id", self.block_tokens, self.rope_theta),
                 _str(self.rope_mode),
                 struct.pack("<II", self.sliding_window or 0, self.format_version),
                 _str(self.package_version), _str(self.kernel_build)]
        return b"".join(parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> CacheSignature:
        """Parse `to_bytes()` output; CorruptBlockError unless it is exactly one valid encoding."""
        r = _Reader(bytes(data))
        magic, version = r.unpack("<4sH")
        if magic != SIG_MAGIC or version != SIG_VERSION:
            raise CorruptBlockError(f"cache signature has magic {magic!r} version {version} "
                                    f"(expected {SIG_MAGIC!r} version {SIG_VERSION})")
        model_id, arch = r.text(), r.text()
        n_layers, n_kv_heads, head_dim = r.unpack("<III")
        dtype = r.text()
        block_tokens, theta = r.unpack("<Id")
        rope_mode = r.text()
        window, fmt = r.unpack("<II")
        package, kernel = r.text(), r.text()
        if r.pos != len(r.data):
            raise CorruptBlockError(f"cache signature has {len(r.data) - r.pos} trailing bytes")
        try:
            return cls(model_id, arch, n_layers, n_kv_heads, head_dim, dtype, block_tokens,
                       theta, rope_mode, window or None, fmt, package, kernel)
        except (ConfigError, BlockLayoutError) as e:
            raise CorruptBlockError(f"cache signature is invalid: {e}") from None


def _str(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<H", len(raw)) + raw


class _Reader:
    """Bounds-checked cursor over signature bytes."""

    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise CorruptBlockError(f"cache signature truncated at byte {self.pos} "
                                    f"({n} more needed, {len(self.data)} in all)")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def unpack(self, fmt: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))

    def text(self) -> str:
        (n,) = self.unpack("<H")
        try:
            return self.take(n).decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptBlockError("cache signature holds a string that is not UTF-8") from None


@dataclass(frozen=True, eq=False)
class KvBlock:
    """One whole block: its chain hash, token ids (block_tokens,) int64, the signature it was
    computed under, and K, V (n_layers, n_kv_heads, block_tokens, head_dim) in the storage
    dtype's array dtype. Treat the arrays as immutable once the block is shared."""

    hash: bytes
    token_ids: np.ndarray
    signature: CacheSignature
    k: np.ndarray
    v: np.ndarray

    def __post_init__(self):
        sig = self.signature
        if not isinstance(self.hash, bytes) or len(self.hash) != 32:
            raise DimensionError(f"a block hash has 32 bytes, got {self.hash!r:.80}")
        ids = self.token_ids
        if not isinstance(ids, np.ndarray) or ids.dtype != np.int64 \
                or ids.shape != (sig.block_tokens,):
            raise DimensionError(f"token_ids must be int64 of shape ({sig.block_tokens},), got "
                                 f"{getattr(ids, 'dtype', None)} {getattr(ids, 'shape', None)}")
        for name in ("k", "v"):
            arr = getattr(self, name)
            if not isinstance(arr, np.ndarray) or arr.shape != sig.block_shape \
                    or arr.dtype != sig.dtype.array_dtype:
                raise DimensionError(f"{name} must be {sig.dtype.array_dtype} of shape "
                                     f"{sig.block_shape}, got {getattr(arr, 'dtype', None)} "
                                     f"{getattr(arr, 'shape', None)}")

    @property
    def nbytes(self) -> int:
        """Bytes held in RAM: K + V rows, token ids and hash."""
        return self.k.nbytes + self.v.nbytes + self.token_ids.nbytes + len(self.hash)
