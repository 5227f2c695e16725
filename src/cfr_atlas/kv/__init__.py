"""K/V storage outside the hot cache: the spilled page file of a live sequence, the paged block
pool, chained block hashes, the cache signature, and the persistent prefix cache (RAM + disk,
and the shared Redis tier of kv/redis_store.py, not imported here: the redis client loads only
when a store is asked for).

Sits on `atlas` (page keys, storage dtypes); models and generation sit above it.
"""

from cfr_atlas.kv.block_format import decode_block, encode_block, encoded_size
from cfr_atlas.kv.block_hash import BlockHash, block_hash, chain_hashes, root_hash
from cfr_atlas.kv.block_pool import KvBlockPool, PagedKvCache
from cfr_atlas.kv.disk_store import DiskKvStore, ReadOutcome, ReadReason, StoreStats
from cfr_atlas.kv.page_file import SpillKv, clean_stale, default_cache_dir
from cfr_atlas.kv.prefix_cache import PrefixCache, PrefixStats
from cfr_atlas.kv.signature import (
    KV_FORMAT_VERSION,
    BlockLayout,
    CacheSignature,
    KvBlock,
    aligned_block_size,
)

__all__ = [
    "KV_FORMAT_VERSION", "BlockHash", "BlockLayout", "CacheSignature", "DiskKvStore", "KvBlock",
    "KvBlockPool", "PagedKvCache", "PrefixCache", "PrefixStats", "ReadOutcome", "ReadReason",
    "SpillKv", "StoreStats", "aligned_block_size", "block_hash", "chain_hashes", "clean_stale",
    "decode_block", "default_cache_dir", "encode_block", "encoded_size", "root_hash",
]
