"""Prefix reuse for sessions: map cached whole blocks in, build new blocks as rows are computed.

`PrefixTier` belongs to a `Model`: one `DiskKvStore` and one shared `RedisKvStore` (each
optional) and one `PrefixCache` per (page size, storage dtype), whose signatures differ so
their chains never meet. A session
whose prompt starts with cached blocks gets those rows written into its hot cache as the policy
allows; a spill session also writes them to its page file, and a recompute session (which has
no layer inputs for them) keeps them: `BlockSource` serves every page of the mapped prefix from
the blocks (blocks and pages have the same size). A new block is read back (hot cache or
regenerator) and inserted once whole, so a later prompt (or a restarted process) reuses it;
no partial block is buffered.

Exactness: a block's rows are bitwise the rows a cold prefill computes (batch-invariant
kernels), so logits after a mapped prefix equal a cold run's. Not here: what a block file looks
like (kv/block_format.py) or which blocks stay in RAM (kv/prefix_cache.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from cfr_atlas.atlas import PageKey, widen
from cfr_atlas.errors import ConfigError
from cfr_atlas.kv import CacheSignature, DiskKvStore, KvBlock, PrefixCache, block_hash

DEFAULT_RAM_BYTES = 256 << 20
DEFAULT_DISK_BYTES = 8 << 30
MAX_SALT = 4096


def default_prefix_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("cfr-atlas")) / "prefix"


class PrefixTier:
    """The model's prefix caches (RAM + one shared disk store)."""

    def __init__(self, net, model_id: str, folder, *, ram_bytes: int = DEFAULT_RAM_BYTES,
                 disk_bytes: int = DEFAULT_DISK_BYTES, store: str | None = None,
                 store_ttl: int | None = None):
        self.net, self.model_id, self.ram_bytes = net, model_id, ram_bytes
        self.disk = None if folder is None else DiskKvStore(Path(folder).expanduser(),
                                                            budget_bytes=disk_bytes)
        self.remote = None
        if store is not None:  # imported here: the redis client only when a store is asked for
            from cfr_atlas.kv.redis_store import RedisKvStore

            self.remote = RedisKvStore(store, ttl_seconds=store_ttl)
        self.caches: dict[tuple[int, str], PrefixCache] = {}

    def cache(self, page_tokens: int, storage_dtype: str) -> PrefixCache:
        key = (page_tokens, storage_dtype)
        if key not in self.caches:
            c = self.net.config
            sig = CacheSignature(model_id=self.model_id, architecture=c.arch, n_layers=c.n_layers,
                                 n_kv_heads=c.n_kv_heads, head_dim=c.head_dim,
                                 storage_dtype=storage_dtype, block_tokens=page_tokens,
                                 rope_theta=c.rope_theta, rope_mode=c.rope_mode)
            self.caches[key] = PrefixCache(sig, ram_bytes=self.ram_bytes, disk=self.disk,
                                           remote=self.remote)
        return self.caches[key]

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
        if self.remote is not None:
            self.remote.close()


def held_bytes(blocks) -> int:
    """Array bytes a session holds for mapped blocks (K + V rows, token ids): what it charges
    to its budget and reports as `prefix_blocks`."""
    return sum(b.k.nbytes + b.v.nbytes + b.token_ids.nbytes for b in blocks)


class BlockSource:
    """KvRegenerator: pages of the mapped prefix from their blocks, other pages from `rest`."""

    def __init__(self, blocks: list[KvBlock], rest):
        self.blocks, self.rest = blocks, rest
        self.block_tokens = blocks[0].signature.block_tokens if blocks else 1
        self.dtype = blocks[0].signature.dtype if blocks else None

    def regenerate_page(self, key: PageKey, tokens: range, k_out, v_out) -> None:
        b = key.start_token // self.block_tokens
        if b < len(self.blocks) and len(tokens) == self.block_tokens:
            block = self.blocks[b]
            k_out[...] = widen(block.k[key.layer, key.kv_head], self.dtype)
            v_out[...] = widen(block.v[key.layer, key.kv_head], self.dtype)
        else:
            self.rest.regenerate_page(key, tokens, k_out, v_out)

    @property
    def keeps_mapped_blocks(self) -> bool:
        return self.rest.keeps_mapped_blocks

    @property
    def records_rows(self) -> bool:
        return getattr(self.rest, "records_rows", True)

    def record(self, layer: int, pos0: int, x, k, v) -> None:
        self.rest.record(layer, pos0, x, k, v)

    def record_block(self, layer: int, pos0: int, k_st, v_st) -> None:
        self.rest.record_block(layer, pos0, k_st, v_st)

    def allocations(self) -> dict[str, int]:
        return {**self.rest.allocations(), "prefix_blocks": held_bytes(self.blocks)}

    def table_bytes(self) -> int:
        return self.rest.table_bytes()

    @property
    def bytes_read(self) -> int:
        return self.rest.bytes_read

    def close(self) -> None:
        self.rest.close()


def check_salt(cache_salt) -> str:
    """A request's `cache_salt`: a string of at most MAX_SALT UTF-8 bytes, else ConfigError."""
    try:
        size = len(cache_salt.encode("utf-8")) if isinstance(cache_salt, str) else None
    except UnicodeEncodeError:  # a lone surrogate: no UTF-8 form to hash
        raise ConfigError("cache_salt", "is not valid Unicode text (lone surrogate)") from None
    if size is None or size > MAX_SALT:
        shown = cache_salt if size is None else f"{len(cache_salt)} chars"
        raise ConfigError("cache_salt", f"must be a string of at most {MAX_SALT} bytes, "
                                        f"got {shown!r:.80}")
    return cache_salt


def salted_root(cache: PrefixCache, cache_salt: str = "") -> bytes:
    """The chain root of a session: the cache's signature plus the request's `cache_salt`
    (an extra key of the root, so every block hash of two salts differs; "" = no salt, the
    shared namespace)."""
    return cache.root(("cache_salt", check_salt(cache_salt)) if cache_salt else ())


class BlockBuilder:
    """Inserts a session's blocks once whole, reading their rows back then (no copy is kept
    while a block fills: the rows come from the hot cache or the regenerator, bitwise the
    stored ones); the assembled block goes straight to the process-wide prefix cache. Block
    hashes chain from `root` (`salted_root`)."""

    def __init__(self, cache: PrefixCache, root: bytes):
        self.cache, self.root = cache, root
        self.sig = cache.signature
        self.chain: list[bytes] = []

    def complete(self, token_ids: list[int], n_tokens: int, page_rows) -> int:
        """Insert every block now whole (all layers computed); returns how many.

        page_rows(layer, kv_head, start, n) -> (k, v) (n, head_dim) in storage dtype."""
        B, done = self.sig.block_tokens, 0
        n_layers, n_kv = self.sig.n_layers, self.sig.n_kv_heads
        while (len(self.chain) + 1) * B <= n_tokens:
            b = len(self.chain)
            ids = np.asarray(token_ids[b * B:(b + 1) * B], dtype=np.int64)
            parent = self.chain[-1] if self.chain else self.root
            h = block_hash(parent, ids)
            dt = self.sig.dtype.array_dtype
            k, v = np.empty(self.sig.block_shape, dtype=dt), np.empty(self.sig.block_shape, dt)
            for layer in range(n_layers):
                for head in range(n_kv):
                    k[layer, head], v[layer, head] = page_rows(layer, head, b * B, B)
            self.chain.append(h)
            self.cache.insert(KvBlock(h, ids, self.sig, k, v), root=self.root,
                              first=self.chain[0])
            done += 1
        return done
