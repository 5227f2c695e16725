"""cfr-atlas: exact long-context LLM inference on the CPU with virtual K/V memory.

The virtualization runtime (`Atlas` and friends) is importable from here. `load_model` and
`Model` are exported too, but resolved lazily (PEP 562 `__getattr__`): `import cfr_atlas` does
not import the model, tokenizer or serving code until one of them is first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cfr_atlas.atlas import (
    LRU,
    Atlas,
    AtlasConfig,
    AttentionRequest,
    KeepAll,
    KeepRecent,
    KeepSinksAndRecent,
    KvRegenerator,
    NeverAdmit,
    PageKey,
    SyntheticKv,
    Telemetry,
)
from cfr_atlas.errors import (
    AtlasError,
    CapacityError,
    ConfigError,
    CorruptPageError,
    DimensionError,
    NumericError,
    PageError,
    RegeneratorError,
)
from cfr_atlas.jit_cache import install as _install_cache_lock

if TYPE_CHECKING:
    from cfr_atlas.engine import Model, load_model

_install_cache_lock()  # kernels stamped with the sources; turns at the cache (jit_cache.py)

__version__ = "0.1.0"

# name -> module that defines it, imported on first access.
_LAZY = {"load_model": "cfr_atlas.engine", "Model": "cfr_atlas.engine"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'cfr_atlas' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))

__all__ = [
    "LRU", "Atlas", "AtlasConfig", "AtlasError", "AttentionRequest", "CapacityError",
    "ConfigError", "CorruptPageError", "DimensionError", "KeepAll", "KeepRecent",
    "KeepSinksAndRecent", "KvRegenerator", "Model", "NeverAdmit", "NumericError", "PageError",
    "PageKey", "RegeneratorError", "SyntheticKv", "Telemetry", "load_model",
]
