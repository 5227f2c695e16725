"""Test support that ships with the package: tiny GGUF models written on demand.

Nothing here is used by the engine at run time; it exists so tests and benchmarks never need
weights from outside.
"""

from cfr_atlas.testing.tiny_gguf import (
    ARCHS,
    MATRIX_ROLES,
    SUPPORTED_QTYPES,
    build_vocab,
    bytes_to_unicode,
    llama3_rope_factors,
    rewrite_gguf,
    tiny_model_path,
    write_tiny_gguf,
)

__all__ = [
    "ARCHS",
    "MATRIX_ROLES",
    "SUPPORTED_QTYPES",
    "build_vocab",
    "bytes_to_unicode",
    "llama3_rope_factors",
    "rewrite_gguf",
    "tiny_model_path",
    "write_tiny_gguf",
]
