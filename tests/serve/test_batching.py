"""Continuous batching, measured from outside: N concurrent requests through the official
`ollama` and `openai` clients — different prompts and lengths, K/V budgets, seeds, temperatures
and stops — held until all are queued, then released into the same batched steps. Every
response equals `Model.generate` run alone with the same options, character for character;
the batch-size histogram proves they really shared forward passes; /metrics exposes it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import httpx
import ollama
import openai
import pytest
from serve_support import MODEL, small_budget, start_server

from cfr_atlas.engine import load_model

LONG = " ".join(["the city of Paris is the capital of France"] * 70)  # > 600 tokens: 3+ chunks


@dataclass
class Case:
    api: str  # "ollama" or "openai"
    prompt: str
    n: int  # tokens to generate at most
    stream: bool = False
    sampling: dict = field(default_factory=dict)  # engine names: temperature, seed, top_k, ...
    stop: tuple[str, ...] = ()
    kv_budget: int | None = None


def _cases(budget: int) -> list[Case]:
    return [
        Case("ollama", "hello world", 12, stream=True),
        Case("ollama", LONG, 10, sampling={"temperature": 0.9, "seed": 7}, kv_budget=budget),
        Case("openai", "The capital of France", 16, stream=True,
             sampling={"temperature": 1.2, "seed": 3}),
        Case("openai", "I have a model", 9, kv_budget=2 * budget),
        Case("ollama", "Paris is a city", 14, stream=True, stop=("the",),
             sampling={"temperature": 0.7, "top_k": 10, "seed": 5, "repeat_penalty": 1.1}),
        Case("openai", LONG[:300], 20, sampling={"temperature": 0.5, "seed": 1}),
        Case("ollama", "A token", 3),
        Case("openai", "Hello Paris", 25, stream=True, kv_budget=budget,
             sampling={"temperature": 1.0, "seed": 11, "top_p": 0.9}),
    ]


def _ask(url: str, case: Case) -> str:
    if case.api == "ollama":
        o = ollama.Client(host=url, timeout=120)
        opts = {"num_predict": case.n, **case.sampling}
        if case.stop:
            opts["stop"] = list(case.stop)
        if case.kv_budget is not None:
            opts["kv_budget"] = case.kv_budget
        r = o.generate(model=MODEL, prompt=case.prompt, raw=True, stream=case.stream,
                       options=opts)
        return "".join(c.response for c in r) if case.stream else r.response
    ai = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    std = {k: v for k, v in case.sampling.items() if k in ("temperature", "seed", "top_p")}
    extra = {k: v for k, v in case.sampling.items() if k not in std}
    if case.kv_budget is not None:
        extra["kv_budget"] = case.kv_budget
    r = ai.completions.create(model=MODEL, prompt=case.prompt, max_tokens=case.n,
                              stream=case.stream, stop=list(case.stop) or None,
                              extra_body=extra or None, **std)
    return "".join(c.choices[0].text for c in r) if case.stream else r.choices[0].text


@pytest.fixture(scope="module")
def batching_server(tiny_llama, tmp_path_factory):
    s = start_server(load_model(tiny_llama), tmp_path_factory.mktemp("batch_pages"),
                     max_active=8, max_queue=16)
    yield s
    s.stop()


def test_concurrent_requests_are_bitwise_their_solo_runs(batching_server, reference, tmp_path):
    server = batching_server
    cases = _cases(small_budget(reference))
    expected = [reference.generate(c.prompt, max_tokens=c.n, stop=list(c.stop),
                                   cache_dir=tmp_path, **c.sampling,
                                   **({} if c.kv_budget is None else {"kv_budget": c.kv_budget}))
                for c in cases]
    before = server.stats()
    got: dict[int, str] = {}
    server.service.scheduler.hold(True)  # all requests queue up, then start together
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _ask(server.url,
                                                                           cases[i])))
               for i in range(len(cases))]
    for t in threads:
        t.start()
    try:
        server.wait_for(lambda s: s.queued == len(cases), what="every request queued")
    finally:
        server.service.scheduler.hold(False)
    for t in threads:
        t.join(120)
    assert [got.get(i) for i in range(len(cases))] == expected
    assert all(expected), expected  # no empty answer makes the comparison vacuous
    after = server.wait_for(lambda s: s.active == 0, what="idle")
    assert after.completed - before.completed == len(cases) and after.failed == before.failed
    # they really shared passes: some steps carried all 8 sequences, and the steps were fewer
    # than the tokens generated one sequence at a time would need
    sizes = dict(after.batch_sizes.buckets())
    old = dict(before.batch_sizes.buckets())
    assert sizes[float("inf")] - sizes[6] - (old[float("inf")] - old[6]) > 0
    assert after.steps - before.steps < after.generated_tokens - before.generated_tokens
    assert after.queue_seconds.count - before.queue_seconds.count == len(cases)


def test_metrics_histograms_are_prometheus_text(batching_server):
    ollama.Client(host=batching_server.url).generate(model=MODEL, prompt="hi", raw=True,
                                                     options={"num_predict": 2})
    text = httpx.get(batching_server.url + "/metrics").text
    for name in ("cfr_atlas_batch_size", "cfr_atlas_batch_tokens", "cfr_atlas_queue_seconds"):
        assert f"# TYPE {name} histogram" in text
        lines = [x for x in text.splitlines() if x.startswith(name + "_")]
        buckets = [(x.split('le="')[1].split('"')[0], float(x.rsplit(" ", 1)[1]))
                   for x in lines if "_bucket{" in x]
        counts = [n for _, n in buckets]
        assert counts == sorted(counts) and buckets[-1][0] == "+Inf"  # cumulative
        count = float(next(x for x in lines if x.startswith(name + "_count ")).split()[1])
        total = float(next(x for x in lines if x.startswith(name + "_sum ")).split()[1])
        assert counts[-1] == count >= 1 and total > 0
