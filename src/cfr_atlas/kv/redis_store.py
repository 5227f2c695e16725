"""`RedisKvStore`: whole K/V blocks in a Redis shared by every replica, the tier below disk.

A block is one Redis string holding exactly its `.kvb` bytes (block_format.py: magic, version,
signature, chain hash, token ids, K, V, SHA-256), under the key

    cfr-atlas:kv1:<model>:<root>:{<first>}:<hash>
    model = SHA-256 of the model id, root = the chain root, first = the hash of block 0 of the
    chain (16 hex digits each); hash = the block's own chain hash (64 hex digits)

The model id and the chain root (signature + `cache_salt`, block_hash.py) namespace the keys:
replicas of other models, builds or tenants never read each other's blocks. The `{...}` hash
tag puts every block of one chain in one Redis Cluster slot, so a chain is still read in one
round trip there (docs/SCALING.md).

Reads: `get_run` fetches a whole chain in one pipelined round trip, per block a bounded
`GETRANGE key 0 <block size>` (a hostile value is never read past one byte more than a block)
and `EXISTS` (or `EXPIRE` with a TTL, which also refreshes it). Nothing from Redis is trusted:
a value of the wrong size or type, a bad checksum, another signature, or other token ids is
counted, deleted (only if the key still holds those bytes: a compare-and-delete script, so a
good block another replica wrote meanwhile stays) and reported as a miss, so the caller
recomputes and re-publishes the block. Writes are write-behind: `put` appends to a queue
bounded in bytes and returns at once (a full queue drops the block and counts it); one thread
writes `SET key value NX [EX ttl]`, so concurrent writers of one block leave one copy.

Failures: every call has a short socket timeout and no client-side retry; any Redis error
counts, opens the `Breaker` (breaker.py) and is reported as a miss or a dropped write, never
raised. While open, the store is skipped at once; after the backoff one call probes it, and
redis-py reconnects by itself. Eviction is Redis's (`maxmemory-policy allkeys-lru`) plus the
optional TTL; this module never scans the keyspace. It does not decide what to cache
(prefix_cache.py does).
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.exceptions import RedisError
from redis.retry import Retry

from cfr_atlas.errors import ConfigError, CorruptBlockError, IncompatibleBlockError
from cfr_atlas.kv.block_format import decode_block, encode_block, encoded_size
from cfr_atlas.kv.breaker import Breaker
from cfr_atlas.kv.signature import CacheSignature, KvBlock

KEY_PREFIX = b"cfr-atlas:kv1"
DEFAULT_TIMEOUT = 0.25  # seconds per socket operation (connect, send, receive)
DEFAULT_QUEUE_BYTES = 256 << 20
SCHEMES = ("redis://", "rediss://", "unix://")
log = logging.getLogger(__name__)
SKIPPED, FAILED = object(), object()  # what `_call` returns instead of a result

# Delete KEYS[1] only if it still holds the rejected value (SHA-1 of its first ARGV[2] + 1
# bytes, as read) or is not a string at all; a valid block written since is kept.
_DELETE_IF_SAME = """
local kind = redis.call('TYPE', KEYS[1])['ok']
if kind == 'none' then return 0 end
if kind == 'string' and
   redis.sha1hex(redis.call('GETRANGE', KEYS[1], 0, ARGV[2])) ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


@dataclass(frozen=True)
class RemoteStats:
    hits: int  # blocks served
    misses: int  # lookups that ended at a block Redis does not hold (at most one per lookup)
    corrupt: int  # values deleted: wrong size or type, bad format or checksum, misfiled
    incompatible: int  # values deleted: another signature under our key
    token_mismatches: int  # values deleted: other token ids under our key
    bytes_read: int
    writes: int  # blocks stored
    present: int  # writes skipped by Redis: the key already held a block (NX)
    bytes_written: int
    dropped: int  # writes not done: queue full, breaker open, or Redis refused (e.g. OOM)
    skipped_reads: int  # lookups that skipped Redis: the breaker open
    errors: int  # failed calls: timeouts and lost connections open the breaker; a refusal
    #              Redis answers (OOM under noeviction, READONLY) does not
    breaker_opens: int
    breaker_state: int  # BreakerState: 0 closed, 1 open, 2 half-open
    queued_bytes: int  # encoded bytes waiting in the write-behind queue
    read_seconds: float
    write_seconds: float


_COUNTERS = tuple(f.name for f in fields(RemoteStats)
                  if f.name not in ("breaker_opens", "breaker_state", "queued_bytes"))


def chain_key(model_id: str, root: bytes, first: bytes, block_hash: bytes) -> bytes:
    """The Redis key of a block (module docstring); `first`: the hash of block 0 of its chain."""
    model = hashlib.sha256(model_id.encode()).hexdigest()[:16].encode()
    return b"%s:%s:%s:{%s}:%s" % (KEY_PREFIX, model, root[:8].hex().encode(),
                                  first[:8].hex().encode(), block_hash.hex().encode())


def connect(url: str, timeout: float = DEFAULT_TIMEOUT) -> redis.Redis:
    """A client for `url` (redis://HOST:PORT/DB, rediss://, unix://) with `timeout` on every
    socket operation and no retries (the breaker decides when to try again); query options in
    the URL (e.g. ?socket_timeout=1) override. Connects lazily: a down Redis is not an error."""
    if not isinstance(url, str) or not url.startswith(SCHEMES):
        shown = shown_url(url) if isinstance(url, str) else url
        raise ConfigError("prefix_store", f"must be a redis://HOST:PORT/DB URL (or rediss://, "
                                          f"unix://), got {shown!r:.120}")
    try:
        return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout,
                                    retry=Retry(NoBackoff(), 0), health_check_interval=0)
    except ValueError as e:
        raise ConfigError("prefix_store", f"{shown_url(url)!r:.120}: {e}") from None


def shown_url(url: str) -> str:
    """`url` with any password replaced by ***, for logs and errors: the user-info one
    (redis://:pw@host) and the `password` query parameter redis-py also reads."""
    parts = urlsplit(url)
    if parts.password is not None:
        netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
        parts = parts._replace(netloc=netloc)
    if parts.query:
        query = [(k, "***" if k.lower() == "password" else v)
                 for k, v in parse_qsl(parts.query, keep_blank_values=True)]
        parts = parts._replace(query=urlencode(query, safe="*"))
    return urlunsplit(parts)


class RedisKvStore:
    """Blocks in Redis behind a breaker and a write-behind queue (see module docstring)."""

    def __init__(self, url: str, *, ttl_seconds: int | None = None,
                 timeout: float = DEFAULT_TIMEOUT, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 breaker: Breaker | None = None):
        if ttl_seconds is not None and (isinstance(ttl_seconds, bool) or not isinstance(
                ttl_seconds, int) or ttl_seconds < 1):
            raise ConfigError("prefix_store_ttl", f"must be a whole number of seconds >= 1, "
                                                  f"got {ttl_seconds!r}")
        if isinstance(queue_bytes, bool) or not isinstance(queue_bytes, int) or queue_bytes < 0:
            raise ConfigError("queue_bytes", f"must be an integer >= 0, got {queue_bytes!r}")
        self.ttl, self.queue_bytes = ttl_seconds, queue_bytes
        self.redis = connect(url, timeout)
        self.where = shown_url(url)  # for logs: without the password
        self.breaker = breaker or Breaker()
        self._delete = self.redis.register_script(_DELETE_IF_SAME)
        self._count = dict.fromkeys(_COUNTERS, 0)
        self._count_lock = threading.Lock()
        self._refusals: set[str] = set()  # kinds of Redis refusal already logged
        self._cv = threading.Condition()
        self._todo: deque[tuple[bytes, KvBlock, int]] = deque()
        self._queued = 0  # bytes in _todo plus the one being written
        self._busy = self._closed = False
        self._thread = threading.Thread(target=self._worker, name="kv-redis-writer", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def _add(self, **counts) -> None:
        with self._count_lock:
            for name, n in counts.items():
                self._count[name] += n

    def _call(self, fn):
        """fn() under the breaker: its result, or SKIPPED (breaker open) or FAILED (counted)."""
        if not self.breaker.allow():
            return SKIPPED
        try:
            result = fn()
        except redis.ResponseError as e:  # Redis is up and answered no (OOM under noeviction,
            self._add(errors=1)           # READONLY replica): this call fails, others go on
            if type(e).__name__ not in self._refusals:
                self._refusals.add(type(e).__name__)
                log.warning("prefix store %s refused a command: %s (counted as errors; "
                            "logged once)", self.where, e)
            return FAILED
        except Exception as e:  # timeouts, connections or anything unforeseen: back off
            self.breaker.failure()
            self._add(errors=1)
            log.warning("prefix store %s: %s: %s (skipped for %.1f s)", self.where,
                        type(e).__name__, e, self.breaker.delay)
            return FAILED
        self.breaker.success()
        return result

    # --- reading -------------------------------------------------------------------------------
    def get_run(self, signature: CacheSignature, root: bytes, hashes: list[bytes],
                token_blocks: list[np.ndarray], start: int) -> list[KvBlock]:
        """Blocks hashes[start:], the longest consecutive verified run from `start` (module
        docstring); hashes[0] is block 0 of the chain, token_blocks[i] the ids of block i."""
        if start >= len(hashes):
            return []
        t0, size = time.perf_counter(), encoded_size(signature)
        keys = [chain_key(signature.model_id, root, hashes[0], h) for h in hashes[start:]]
        values = self._call(lambda: self._read(keys, size))
        if values is SKIPPED or values is FAILED:
            self._add(skipped_reads=int(values is SKIPPED))
            return []
        found = []
        for i, key in enumerate(keys):
            block = self._verify(key, values[2 * i], values[2 * i + 1], hashes[start + i],
                                 token_blocks[start + i], signature, size)
            if block is None:
                break
            found.append(block)
        self._add(hits=len(found), misses=int(len(found) < len(keys)),
                  read_seconds=time.perf_counter() - t0)
        return found

    def _read(self, keys: list[bytes], size: int) -> list:
        """One round trip: per key its first size + 1 bytes and whether it exists."""
        pipe = self.redis.pipeline(transaction=False)
        for key in keys:
            pipe.getrange(key, 0, size)  # inclusive end: a longer value shows one byte more
            if self.ttl is None:
                pipe.exists(key)
            else:
                pipe.expire(key, self.ttl)  # 1 if the key exists, and its TTL starts again
        values = pipe.execute(raise_on_error=False)
        for v in values:  # WRONGTYPE is the value's fault; any other error is Redis's
            if isinstance(v, RedisError) and not str(v).startswith("WRONGTYPE"):
                raise v
        return values

    def _verify(self, key: bytes, value, exists, block_hash: bytes, tokens: np.ndarray,
                signature: CacheSignature, size: int) -> KvBlock | None:
        """The block if `value` is one we may use; else None, and a bad value is deleted."""
        if exists == 0:
            return None  # a plain miss (GETRANGE of a missing key is b"")
        reason = "corrupt"
        try:
            if isinstance(value, RedisError):
                raise CorruptBlockError(f"not a string value: {value}")
            if len(value) != size:
                more = "+" if len(value) > size else ""
                raise CorruptBlockError(f"value of {len(value)}{more} bytes, a block under "
                                        f"this signature has {size}")
            block = decode_block(value, block_hash, signature)
            if np.array_equal(block.token_ids, tokens):
                self._add(bytes_read=size)
                return block
            reason, detail = "token_mismatches", "other token ids than requested"
        except IncompatibleBlockError as e:
            reason, detail = "incompatible", str(e)
        except (CorruptBlockError, ValueError) as e:  # ValueError: a shape no check foresaw
            detail = str(e)
        self._reject(key, value, reason, detail, size)
        return None

    def _reject(self, key: bytes, value, reason: str, detail: str, size: int) -> None:
        self._add(**{reason: 1})
        log.warning("prefix store %s: deleting %s: %s", self.where, key.decode(), detail)
        digest = hashlib.sha1(value if isinstance(value, bytes) else b"").hexdigest()
        self._call(lambda: self._delete(keys=[key], args=[digest, size]))

    # --- writing -------------------------------------------------------------------------------
    def put(self, signature: CacheSignature, root: bytes, first: bytes, block: KvBlock) -> None:
        """Queue `block` (block 0 of its chain: `first`) for writing; never blocks. Dropped and
        counted if the queue's byte bound would be exceeded (the writer drops it, counted, if
        the breaker is open when its turn comes)."""
        size = encoded_size(signature)
        key = chain_key(signature.model_id, root, first, block.hash)
        with self._cv:
            if self._closed or self._queued + size > self.queue_bytes:
                self._add(dropped=1)
                return
            self._todo.append((key, block, size))
            self._queued += size
            self._cv.notify()

    def _worker(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._todo or self._closed)
                if not self._todo:
                    return
                key, block, size = self._todo.popleft()
                self._busy = True
            try:
                self._write(key, block)
            except Exception:  # a bug: keep the writer alive, the block is simply not stored
                log.exception("prefix store %s: writer error", self.where)
                self._add(dropped=1)
            finally:
                with self._cv:
                    self._queued -= size
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, key: bytes, block: KvBlock) -> None:
        t0 = time.perf_counter()
        data = encode_block(block)
        stored = self._call(lambda: self.redis.set(key, data, nx=True, ex=self.ttl))
        if stored is SKIPPED or stored is FAILED:
            self._add(dropped=1)
        elif stored:
            self._add(writes=1, bytes_written=len(data))
        else:
            self._add(present=1)
        self._add(write_seconds=time.perf_counter() - t0)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued block is written or dropped; False if `timeout` ran out."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._todo and not self._busy, timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Write what is queued (for at most `timeout` seconds), then stop; idempotent."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout)
        self.redis.close()
        atexit.unregister(self.close)

    def stats(self) -> RemoteStats:
        with self._count_lock:
            counts = dict(self._count)
        with self._cv:
            queued = self._queued
        return RemoteStats(**counts, breaker_opens=self.breaker.opens,
                           breaker_state=int(self.breaker.state), queued_bytes=queued)
