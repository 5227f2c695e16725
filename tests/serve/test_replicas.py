"""Two real `cfr-atlas serve` processes (the bundled SmolLM2-135M) sharing one real Redis:
a prompt prefilled by replica A is cached on replica B, which answers bitwise what it answers
cold; a corrupted block in Redis is detected, deleted, recomputed and re-published bitwise;
two replicas writing one block at once leave one valid copy; killing Redis mid-stream loses
no request, and the replicas use Redis again once it is back.

Prompts are ~300 tokens: one whole block of 256 (the server's page size) and a tail."""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import threading
import time

import httpx
import pytest

from cfr_atlas.testing.redis_server import RedisServer, RedisUnavailable, free_port
from cfr_atlas.validate import validation_text

BLOCK = 256  # tokens of one block: the server sessions' page_tokens


def prompt(i: int) -> str:
    """A distinct ~300-token prose prompt (its first token differs: its own chain)."""
    words = validation_text().split()
    return f"Part {i}. " + " ".join(words[i * 250:i * 250 + 210])


class Replica:
    def __init__(self, model, redis_url, log_path):
        self.port, self.log_path = free_port(), log_path
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "cfr_atlas.cli", "serve", "--port", str(self.port),
               "--model", str(model), "--name", "smol", "--prefix-store", redis_url]
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env=os.environ.copy())

    def wait_ready(self, timeout=300.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"replica exited: {self.log()}")
            try:
                httpx.get(self.url + "/api/version", timeout=1)
                return
            except httpx.TransportError:
                time.sleep(0.2)
        pytest.fail(f"replica did not answer in {timeout} s: {self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def generate(self, text, salt=None, n=4) -> dict:
        body = {"model": "smol", "prompt": text, "raw": True, "stream": False,
                "options": {"num_predict": n, "temperature": 0}}
        if salt is not None:
            body["cache_salt"] = salt
        r = httpx.post(self.url + "/api/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_eval_count"] > BLOCK  # a whole block to share
        return r.json()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for m in re.finditer(r"^cfr_atlas_prefix_store_(\w+?)(?:\{reason=\"(\w+)\"\})? (\S+)$",
                             text, re.M):
            out[m[1] + (f":{m[2]}" if m[2] else "")] = float(m[3])
        return out

    def wait_written(self, at_least: float, timeout=30.0) -> dict:
        """Until the write-behind queue is empty and `writes + present + dropped` >= at_least."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            m = self.metrics()
            done = m["writes_total"] + m["present_total"] + m["dropped_writes_total"]
            if m["queued_bytes"] == 0 and done >= at_least:
                return m
            time.sleep(0.05)
        raise AssertionError(f"writes did not finish: {self.metrics()}")

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture(scope="module")
def redis():
    try:
        server = RedisServer().start()
    except RedisUnavailable as e:
        pytest.fail(f"tests need a real redis-server and none could start: {e}")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def replicas(bundled_model_path, redis, tmp_path_factory):
    folder = tmp_path_factory.mktemp("replicas")
    pair = [Replica(bundled_model_path, redis.url, folder / f"{n}.log") for n in "ab"]
    try:
        for r in pair:
            r.wait_ready()
        yield pair
    finally:
        for r in pair:
            r.stop()


def _writes(r: Replica) -> float:
    m = r.metrics()
    return m["writes_total"] + m["present_total"] + m["dropped_writes_total"]


def _block_keys(redis) -> set[bytes]:
    client = redis.client()
    try:
        return set(client.keys("cfr-atlas:kv1:*"))  # the test lists keys; replicas never scan
    finally:
        client.close()


def _logits(response: dict) -> str:
    """The SHA-256 of every sampled step's float32 logits (generate.py), from the final object."""
    return response["cfr_atlas"]["logits_sha256"]


def _intact(value: bytes) -> bool:
    """The .kvb checksum holds (block_format.py: SHA-256 of everything before the last 32)."""
    return hashlib.sha256(value[:-32]).digest() == value[-32:]


def test_a_prefix_prefilled_on_one_replica_is_cached_on_the_other_bitwise(replicas):
    a, b = replicas
    text = prompt(1)
    cold = b.generate(text, salt="cold")                 # B alone, another namespace
    assert cold["prompt_eval_cached_count"] == 0 and cold["prompt_eval_count"] > BLOCK
    first = a.generate(text)
    assert a.wait_written(0)["writes_total"] >= 1
    warm = b.generate(text)
    assert warm["prompt_eval_cached_count"] == BLOCK
    assert warm["response"] == cold["response"] == first["response"]
    assert _logits(warm) == _logits(cold) == _logits(first)  # every step's logits, bitwise
    m = b.metrics()
    assert m["hits_total"] >= 1 and m["read_bytes_total"] > 0 and m["errors_total"] == 0


def test_a_corrupted_block_is_deleted_recomputed_and_republished(replicas, redis):
    a, b = replicas
    text, before = prompt(2), _block_keys(redis)
    first = a.generate(text)
    a.wait_written(1)
    (key,) = _block_keys(redis) - before
    client = redis.client()
    good = client.get(key)
    client.setrange(key, len(good) // 2, bytes([good[len(good) // 2] ^ 1]))
    written = _writes(b)
    again = b.generate(text)
    assert again["prompt_eval_cached_count"] == 0 and again["response"] == first["response"]
    assert _logits(again) == _logits(first)
    assert b.metrics()["rejected_total:corrupt"] == 1
    b.wait_written(written + 1)
    assert client.get(key) == good                        # recomputed bitwise, stored again
    client.close()


def test_two_replicas_writing_one_block_at_once_leave_one_valid_copy(replicas, redis):
    text, before = prompt(3), _block_keys(redis)
    writes = [r.metrics()["writes_total"] for r in replicas]
    out = [None, None]

    def ask(i):
        out[i] = replicas[i].generate(text)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in replicas:
        r.wait_written(0)
    assert out[0]["response"] == out[1]["response"]
    (key,) = _block_keys(redis) - before                  # one key for the one whole block
    client = redis.client()
    assert _intact(client.get(key))
    client.close()
    new = sum(r.metrics()["writes_total"] - w for r, w in zip(replicas, writes, strict=True))
    assert new == 1                                       # SET NX: a second writer stores nothing


def test_killing_redis_mid_stream_loses_no_request_and_replicas_recover(replicas, redis):
    a, b = replicas
    body = {"model": "smol", "prompt": prompt(4), "raw": True, "stream": True,
            "options": {"num_predict": 16, "temperature": 0}}
    lines = []
    with httpx.stream("POST", a.url + "/api/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if not lines:
                redis.kill()                              # Redis dies under the first token
            lines.append(json.loads(line))
    assert r.status_code == 200 and lines[-1]["done"] and lines[-1]["eval_count"] == 16
    assert not any("error" in x for x in lines)
    t0 = time.monotonic()
    down = b.generate(prompt(5))                          # Redis down: a plain miss
    assert down["prompt_eval_cached_count"] == 0 and time.monotonic() - t0 < 60
    assert b.metrics()["errors_total"] >= 1
    redis.start()                                         # back on the same port, empty
    time.sleep(1.1)                                       # past the breaker's first backoff
    text = prompt(6)
    first = a.generate(text)
    a.wait_written(0)
    time.sleep(1.1)  # B's breaker: at most two failures (its read, its write): 1 s of backoff
    warm = b.generate(text)
    assert warm["prompt_eval_cached_count"] == BLOCK and warm["response"] == first["response"]
    assert b.metrics()["breaker_state"] == 0 and a.metrics()["breaker_state"] == 0
