"""The shared Redis prefix tier end to end in one process: two Models ("replicas") of one file
share blocks through a real Redis, bitwise exact; other files, salts and block sizes never
meet; a dead Redis costs only the hits."""

import numpy as np

from cfr_atlas.engine import load_model

PAGE = 4
IDS = [5, 77, 300, 12, 9, 256, 257, 1, 42, 99, 150, 3, 7, 8, 31, 200, 18, 64, 65, 66, 10, 11]
MAPPED = (len(IDS) - 1) // PAGE * PAGE


def _replica(path, url):
    return load_model(path, prefix_store=url)


def test_a_prefix_computed_by_one_replica_is_reused_by_another_bitwise(tiny_llama, redis_db):
    cold = load_model(tiny_llama).next_logits(IDS, page_tokens=PAGE)
    a, b = _replica(tiny_llama, redis_db.url), _replica(tiny_llama, redis_db.url)
    assert np.array_equal(a.next_logits(IDS, page_tokens=PAGE), cold)
    assert a.prefix.remote.flush(10) and a.prefix_store_stats().writes == len(IDS) // PAGE
    assert np.array_equal(b.next_logits(IDS, page_tokens=PAGE), cold)
    assert b.last_telemetry["prompt_cached_tokens"] == MAPPED
    assert b.generate(IDS, max_tokens=8, page_tokens=PAGE) == \
        load_model(tiny_llama).generate(IDS, max_tokens=8, page_tokens=PAGE)
    assert b.prefix_store_stats().hits == MAPPED // PAGE      # later calls hit b's own RAM
    a.prefix.close()
    b.prefix.close()


def test_salts_and_block_sizes_keep_apart(tiny_llama, redis_db):
    a, b = _replica(tiny_llama, redis_db.url), _replica(tiny_llama, redis_db.url)
    a.next_logits(IDS, page_tokens=PAGE, cache_salt="tenant-a")
    assert a.prefix.remote.flush(10)
    b.next_logits(IDS, page_tokens=PAGE, cache_salt="tenant-b")
    assert b.last_telemetry["prompt_cached_tokens"] == 0
    b.next_logits(IDS, page_tokens=2 * PAGE, cache_salt="tenant-a")
    assert b.last_telemetry["prompt_cached_tokens"] == 0
    b.next_logits(IDS, page_tokens=PAGE, cache_salt="tenant-a")
    assert b.last_telemetry["prompt_cached_tokens"] == MAPPED
    a.prefix.close()
    b.prefix.close()


def test_a_dead_redis_costs_only_the_hits(tiny_llama, redis_factory):
    server = redis_factory()
    cold = load_model(tiny_llama).next_logits(IDS, page_tokens=PAGE)
    m = _replica(tiny_llama, server.url)
    server.kill()
    assert np.array_equal(m.next_logits(IDS, page_tokens=PAGE), cold)
    assert m.last_telemetry["prompt_cached_tokens"] == 0
    assert m.prefix.remote.flush(10)
    st = m.prefix_store_stats()
    assert st.errors == 1 and st.writes == 0 and st.dropped == len(IDS) // PAGE
    m.prefix.close()
