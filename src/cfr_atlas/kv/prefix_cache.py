"""`PrefixCache`: whole K/V blocks by chain hash, in RAM (LRU, byte budget) over a disk store
and a shared remote store (Redis, redis_store.py), each optional.

A lookup hashes the whole blocks of a token sequence (block_hash.py) and walks the chain from
the first block: RAM first, then disk, and stops at the first block found in neither; the
rest of the chain is then asked of the remote store in one round trip. The
result is the longest run of consecutive whole blocks from the start, which is exactly the K/V
the model may reuse; the caller computes the rest. The run is then marked used (disk hits
promoted into RAM) tail first, so under RAM pressure the head of a chain, shared by the most
prompts, is evicted last (remote hits are not copied to disk). A block is served only when its
token ids equal the requested ones and its signature equals the cache's, never by hash alone.
`insert` writes through: RAM, then the disk store's queue, then the remote store's queue
(which needs the block's chain: its root and block 0).

Invariants: `ram_bytes_used` == sum of `nbytes` of the RAM blocks <= ram_bytes; every block in
RAM has this cache's signature. Not thread-safe (one engine thread owns it); the stores
below it are. This module does not compute K/V or pick what to insert; the engine does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import ConfigError, IncompatibleBlockError
from cfr_atlas.kv.block_hash import ExtraKey, chain_hashes, root_hash, token_array
from cfr_atlas.kv.disk_store import DiskKvStore
from cfr_atlas.kv.signature import CacheSignature, KvBlock


@dataclass(frozen=True)
class PrefixStats:
    ram_hits: int
    disk_hits: int
    remote_hits: int
    misses: int  # lookups that stopped before the last whole block (at most one per lookup)
    ram_blocks: int
    ram_bytes: int


class PrefixCache:
    """RAM tier of whole blocks in front of an optional `DiskKvStore` (see module docstring)."""

    def __init__(self, signature: CacheSignature, *, ram_bytes: int,
                 disk: DiskKvStore | None = None, remote=None):
        if not isinstance(signature, CacheSignature):
            raise TypeError(f"expected a CacheSignature, got {type(signature).__name__}")
        if isinstance(ram_bytes, bool) or not isinstance(ram_bytes, int) or ram_bytes < 0:
            raise ConfigError("ram_bytes", f"must be an integer >= 0, got {ram_bytes!r}")
        self.signature, self.ram_bytes, self.disk = signature, ram_bytes, disk
        self.remote = remote  # a RedisKvStore (get_run / put), or None
        self._ram: OrderedDict[bytes, KvBlock] = OrderedDict()  # least recently used first
        self.ram_bytes_used = 0
        self.ram_hits = self.disk_hits = self.remote_hits = self.misses = 0

    def root(self, extra_keys: Sequence[ExtraKey] = ()) -> bytes:
        """The chain root for this cache's signature (the usual `root` argument of lookup)."""
        return root_hash(self.signature.to_bytes(), extra_keys)

    def lookup(self, root: bytes, ids, extra_keys: Sequence[ExtraKey] = ()) -> list[KvBlock]:
        """The longest run of consecutive whole blocks of `ids`, from the first, that is cached."""
        tokens, B = token_array(ids), self.signature.block_tokens
        hashes = chain_hashes(root, tokens, B, extra_keys)
        blocks = [tokens[i * B:(i + 1) * B] for i in range(len(hashes))]
        found: list[KvBlock] = []
        for block_hash, block_tokens in zip(hashes, blocks, strict=True):
            block = self._find(block_hash, block_tokens)
            if block is None:
                break
            found.append(block)
        if len(found) < len(hashes) and self.remote is not None:
            more = self.remote.get_run(self.signature, root, hashes, blocks, len(found))
            self.remote_hits += len(more)
            found += more
        self.misses += len(found) < len(hashes)
        for block in reversed(found):  # tail first: the head, shared most, is evicted last
            self._keep(block)
        return found

    def _find(self, block_hash: bytes, tokens: np.ndarray) -> KvBlock | None:
        block = self._ram.get(block_hash)
        if block is not None and np.array_equal(block.token_ids, tokens):
            self.ram_hits += 1
            return block
        if self.disk is None:
            return None
        outcome = self.disk.get(block_hash, tokens, self.signature)
        if outcome.block is not None:
            self.disk_hits += 1
        return outcome.block

    def insert(self, block: KvBlock, *, root: bytes | None = None,
               first: bytes | None = None) -> None:
        """Cache a whole block computed under this cache's signature: RAM, disk, and (given the
        chain's `root` and the hash of its block 0, `first`) the remote store."""
        if not isinstance(block, KvBlock):
            raise TypeError(f"expected a KvBlock, got {type(block).__name__}")
        field = self.signature.first_mismatch(block.signature)
        if field is not None:
            raise IncompatibleBlockError(field, f"block differs from the cache in {field}: "
                                                f"{getattr(block.signature, field)!r} (cache "
                                                f"{getattr(self.signature, field)!r})")
        self._keep(block)
        if self.disk is not None:
            self.disk.put(block)
        if self.remote is not None and root is not None:
            self.remote.put(self.signature, root, first or block.hash, block)

    def _keep(self, block: KvBlock) -> None:
        """Put a block in RAM, evicting least recently used ones; one larger than the whole
        budget is not kept."""
        old = self._ram.pop(block.hash, None)
        if old is not None:
            self.ram_bytes_used -= old.nbytes
        if block.nbytes > self.ram_bytes:
            return
        while self.ram_bytes_used + block.nbytes > self.ram_bytes:
            _, evicted = self._ram.popitem(last=False)
            self.ram_bytes_used -= evicted.nbytes
        self._ram[block.hash] = block
        self.ram_bytes_used += block.nbytes

    def stats(self) -> PrefixStats:
        return PrefixStats(ram_hits=self.ram_hits, disk_hits=self.disk_hits,
                           remote_hits=self.remote_hits, misses=self.misses,
                           ram_blocks=len(self._ram), ram_bytes=self.ram_bytes_used)
