"""The scheduler under load: interleaved clients all get their exact answers, a client that
disconnects has its session released, a full queue answers 429, /metrics counts it all."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import ollama
import openai
import pytest
from serve_support import MODEL, small_budget

N = 5
PROMPTS = ["hello world", "The capital of France", "Paris is a city", "I have a model",
           "the language of the world", "A token", "Hello Paris", "they would"]


def _client_session(url: str, client_id: int, expected: dict) -> list[bool]:
    """5 requests, one of each kind over both APIs; True for each exact answer."""
    o = ollama.Client(host=url, timeout=120)
    ai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    opts = {"num_predict": N}
    kinds = [
        lambda p: o.generate(model=MODEL, prompt=p, raw=True, options=opts).response,
        lambda p: "".join(c.response for c in o.generate(model=MODEL, prompt=p, raw=True,
                                                         stream=True, options=opts)),
        lambda p: ai.completions.create(model=MODEL, prompt=p, max_tokens=N).choices[0].text,
        lambda p: "".join(c.choices[0].text for c in ai.completions.create(
            model=MODEL, prompt=p, max_tokens=N, stream=True)),
        lambda p: httpx.post(url + "/api/generate", timeout=120, json={
            "model": MODEL, "prompt": p, "raw": True, "stream": False,
            "options": opts}).json()["response"],
    ]
    results = []
    for k, ask in enumerate(kinds):
        prompt = PROMPTS[(client_id + k) % len(PROMPTS)]
        results.append(ask(prompt) == expected[prompt])
    return results


def test_eight_concurrent_clients_all_exact(server, reference):
    expected = {p: reference.generate(p, max_tokens=N) for p in PROMPTS}
    before = server.stats()
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(_client_session, server.url, i, expected) for i in range(8)]
        results = [f.result(timeout=120) for f in futures]
    assert all(all(r) for r in results), results
    after = server.wait_for(lambda s: s.active == 0, what="idle")
    assert after.completed - before.completed == 40
    assert after.failed == before.failed and after.rejected == before.rejected
    assert after.resident_kv_bytes == 0


def _page_files(server) -> list:
    return list(server.cache_dir.glob("seq-*.kvp"))


def test_streaming_disconnect_releases_the_session(server, reference):
    before = server.stats()
    body = {"model": MODEL, "prompt": "hello world", "raw": True,
            "options": {"num_predict": 100000, "kv_budget": small_budget(reference)}}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/api/generate",
                                                  json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert not json.loads(next(lines))["done"]
        assert len(_page_files(server)) == 1  # its spill file, while it runs
        assert server.stats().active == 1
    after = server.wait_for(lambda s: s.active == 0, what="the stream to be released")
    assert after.cancelled == before.cancelled + 1
    assert after.resident_kv_bytes == 0
    assert _page_files(server) == []  # session closed: page file gone


def test_non_streaming_disconnect_releases_the_session(server):
    before = server.stats()
    body = {"model": MODEL, "prompt": "hello world", "stream": False,
            "options": {"num_predict": 100000}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/api/generate", json=body, timeout=httpx.Timeout(30, read=0.5))
    after = server.wait_for(lambda s: s.cancelled > before.cancelled and s.active == 0,
                            what="the request to be cancelled")
    assert after.completed == before.completed


def test_full_queue_answers_429_and_recovers(busy_server):
    url = busy_server.url
    long_body = {"model": MODEL, "prompt": "hello", "raw": True,
                 "options": {"num_predict": 100000}}
    with httpx.Client(timeout=30) as c, c.stream("POST", url + "/api/generate",
                                                  json=long_body) as running:
        lines = running.iter_lines()  # keep it: a collected iterator closes the connection
        next(lines)  # A is active: the only slot
        queued = {}

        def waiting():  # B waits in the queue: its only place
            queued["r"] = httpx.post(url + "/api/generate", timeout=60, json={
                "model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})

        t = threading.Thread(target=waiting)
        t.start()
        busy_server.wait_for(lambda s: s.queued == 1, what="B to queue")
        r = httpx.post(url + "/api/generate", json={"model": MODEL, "prompt": "x"}, timeout=30)
        assert r.status_code == 429 and r.headers["Retry-After"] == "2"
        assert "queue is full" in r.json()["error"]
        with pytest.raises(ollama.ResponseError) as e:
            ollama.Client(host=url).chat(model=MODEL, messages=[{"role": "user", "content": "x"}])
        assert e.value.status_code == 429
        with pytest.raises(openai.RateLimitError):
            openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0).completions.create(
                model=MODEL, prompt="x", max_tokens=1)
    t.join(60)  # A's client is gone -> A released -> B runs
    assert queued["r"].status_code == 200 and queued["r"].json()["done"]
    stats = busy_server.wait_for(lambda s: s.active == 0 and s.queued == 0, what="idle")
    assert stats.rejected == 3 and stats.cancelled >= 1


def test_metrics_prometheus_text(server):
    httpx.post(server.url + "/api/generate", timeout=30, json={
        "model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    r = httpx.get(server.url + "/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    values = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['cfr_atlas_requests_total{path="/api/generate",status="200"}'] >= 1
    for name in ("cfr_atlas_queue_depth", "cfr_atlas_resident_kv_bytes",
                 "cfr_atlas_hot_cache_hits_total", "cfr_atlas_regenerations_total",
                 "cfr_atlas_generated_tokens_total", "cfr_atlas_prompt_tokens_total",
                 "cfr_atlas_jobs_rejected_total", "cfr_atlas_active_sequences"):
        assert name in values
    assert values["cfr_atlas_generated_tokens_total"] >= 2
    assert values["cfr_atlas_hot_cache_hits_total"] > 0
