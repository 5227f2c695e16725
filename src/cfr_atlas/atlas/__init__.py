"""The virtualization runtime: config, pages, hot cache, scratch, policies, fold, telemetry.

Imports only `cfr_atlas.errors` and NumPy/numba; models and generation sit above it.
"""

from cfr_atlas.atlas.config import AtlasConfig
from cfr_atlas.atlas.pages import PageKey
from cfr_atlas.atlas.policy import LRU, KeepAll, KeepRecent, KeepSinksAndRecent, NeverAdmit
from cfr_atlas.atlas.runtime import Atlas, AttentionRequest, KvRegenerator
from cfr_atlas.atlas.storage import StorageDtype, round_rows, widen
from cfr_atlas.atlas.synthetic import SyntheticKv
from cfr_atlas.atlas.telemetry import Counters, Telemetry

__all__ = [
    "Atlas", "AtlasConfig", "AttentionRequest", "Counters", "KeepAll", "KeepRecent",
    "KeepSinksAndRecent", "KvRegenerator", "LRU", "NeverAdmit", "PageKey", "StorageDtype",
    "SyntheticKv", "Telemetry", "round_rows", "widen",
]
