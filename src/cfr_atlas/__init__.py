"""cfr-atlas: exact long-context LLM inference on the CPU with virtual K/V memory.

The virtualization runtime (`Atlas` and friends) is importable from here; models, generation
and serving live in sub-packages and are imported lazily so `import cfr_atlas` stays light.
"""

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

__version__ = "0.1.0"

__all__ = [
    "LRU", "Atlas", "AtlasConfig", "AtlasError", "AttentionRequest", "CapacityError",
    "ConfigError", "CorruptPageError", "DimensionError", "KeepAll", "KeepRecent",
    "KeepSinksAndRecent", "KvRegenerator", "NeverAdmit", "NumericError", "PageError", "PageKey",
    "RegeneratorError", "SyntheticKv", "Telemetry",
]
