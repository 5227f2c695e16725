"""K/V storage outside the hot cache: the spilled page file of a live sequence.

Sits on `atlas` (page keys, storage dtypes); models and generation sit above it.
"""

from cfr_atlas.kv.page_file import SpillKv, clean_stale, default_cache_dir

__all__ = ["SpillKv", "clean_stale", "default_cache_dir"]
