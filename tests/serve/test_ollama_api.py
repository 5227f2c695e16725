"""The Ollama API driven by the official `ollama` package: greedy output equals the engine's."""

from __future__ import annotations

import json

import httpx
import numpy as np
import ollama
import pytest
from serve_support import MODEL, engine_text, small_budget

from cfr_atlas.sampling import SamplingParams

N = 8  # tokens per generation: enough to compare, cheap on two loaded cores


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url, timeout=60)


def chat_prompt(model, prompt, system=None):
    messages = [{"role": "system", "content": system}] if system else []
    return model.chat_ids(messages + [{"role": "user", "content": prompt}])


def test_version_list_show_ps(client, server, reference):
    assert httpx.get(server.url + "/api/version").json()["version"]
    (entry,) = client.list().models
    assert entry.model == "tiny:latest" and entry.details.family == "llama"
    assert entry.size == reference.path.stat().st_size
    info = client.show(MODEL)
    cfg = reference.config
    assert info.modelinfo["general.architecture"] == "llama"
    assert info.modelinfo["llama.block_count"] == cfg.n_layers
    assert info.modelinfo["llama.attention.head_count_kv"] == cfg.n_kv_heads
    assert info.modelinfo["tokenizer.ggml.tokens"] is None  # big arrays only when verbose
    assert info.template == reference.chat_template.template
    assert "completion" in info.capabilities
    (running,) = client.ps().models
    assert running.context_length == cfg.context_length


def test_generate_greedy_equals_engine(client, reference):
    r = client.generate(model=MODEL, prompt="hello world", options={"num_predict": N})
    prompt = chat_prompt(reference, "hello world")
    assert r.response == reference.generate(prompt, max_tokens=N)
    assert r.done and r.done_reason in ("stop", "length")
    assert r.prompt_eval_count == len(prompt)
    assert 0 < r.eval_count <= N
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration > 0


def test_generate_raw_system_and_stream(client, reference):
    raw = client.generate(model=MODEL, prompt="The capital", raw=True,
                          options={"num_predict": N, "temperature": 0})
    assert raw.response == reference.generate("The capital", max_tokens=N)
    chunks = list(client.generate(model=MODEL, prompt="hello", system="Be brief.", stream=True,
                                  options={"num_predict": N}))
    assert chunks[-1].done and not any(c.done for c in chunks[:-1])
    text = "".join(c.response for c in chunks)
    assert text == reference.generate(chat_prompt(reference, "hello", "Be brief."), max_tokens=N)


def test_chat_stream_and_not(client, reference):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    expected = reference.generate(reference.chat_ids(messages), max_tokens=N)
    r = client.chat(model=MODEL, messages=messages, options={"num_predict": N})
    assert r.message.role == "assistant" and r.message.content == expected
    parts = list(client.chat(model=MODEL, messages=messages, stream=True,
                             options={"num_predict": N}))
    assert "".join(p.message.content for p in parts) == expected
    assert parts[-1].done and parts[-1].eval_count == r.eval_count


def test_sampling_options_reach_the_sampler(client, reference):
    opts = {"temperature": 0.9, "top_k": 20, "top_p": 0.9, "min_p": 0.01, "seed": 7,
            "repeat_penalty": 1.2, "repeat_last_n": 8, "num_predict": N}
    r = client.generate(model=MODEL, prompt="hello world", raw=True, options=opts)
    assert r.response == reference.generate(
        "hello world", max_tokens=N, temperature=0.9, top_k=20, top_p=0.9, min_p=0.01, seed=7,
        repeat_penalty=1.2)


def test_stop_string_cuts_and_reports_stop(client, reference):
    full = reference.generate("hello world", max_tokens=N)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    r = client.generate(model=MODEL, prompt="hello world", raw=True,
                        options={"num_predict": N, "stop": [stop]})
    assert r.response == reference.generate("hello world", max_tokens=N, stop=[stop])
    assert r.done_reason == "stop" and stop not in r.response


LONG = " ".join(["the city of Paris is the capital of France"] * 70)  # > 2 prefill chunks


@pytest.mark.parametrize("extra", [{}, {"kv_budget": "small"}, {"repeat_last_n": -1},
                                   {"repeat_last_n": 300}])
def test_long_prompt_chunked_prefill_and_kv_budget_are_exact(server, reference, extra):
    if "kv_budget" in extra:
        extra = {"kv_budget": small_budget(reference)}
    params = SamplingParams(repeat_penalty=1.1, repeat_last_n=extra.get("repeat_last_n", 64))
    opts = {"num_predict": 4, "repeat_penalty": 1.1, **extra}
    r = httpx.post(server.url + "/api/generate", timeout=60, json={
        "model": MODEL, "prompt": LONG, "raw": True, "stream": False, "options": opts})
    body = r.json()
    assert r.status_code == 200, body
    assert body["response"] == engine_text(reference, LONG, params, 4)
    if not extra:
        assert body["response"] == reference.generate(LONG, max_tokens=4, repeat_penalty=1.1)
    assert body["prompt_eval_count"] == len(reference.tokenize(LONG)) > 600
    assert body["prompt_eval_cached_count"] == 0
    telemetry = body["cfr_atlas"]
    if "kv_budget" in extra:
        assert telemetry["budget_bytes"] == extra["kv_budget"]
        assert telemetry["pages_regenerated"] > 0  # the budget really was in force
    else:
        assert telemetry["budget_bytes"] is None


def test_embed_and_old_embeddings(client, reference):
    r = client.embed(model=MODEL, input=["hello world", "Paris"])
    assert len(r.embeddings) == 2 and r.prompt_eval_count == 3
    np.testing.assert_allclose(r.embeddings[0], reference.embedding("hello world"), rtol=1e-6)
    np.testing.assert_allclose(r.embeddings[1], reference.embedding("Paris"), rtol=1e-6)
    short = client.embed(model=MODEL, input="Paris", dimensions=8).embeddings[0]
    assert len(short) == 8 and abs(np.linalg.norm(short) - 1) < 1e-5
    old = client.embeddings(model=MODEL, prompt="Paris")
    np.testing.assert_allclose(old.embedding, reference.embedding("Paris"), rtol=1e-6)


def test_preload_requests_generate_nothing(client, server):
    r = client.generate(model=MODEL, prompt="")
    assert r.done and r.done_reason == "load" and r.response == ""
    r = httpx.post(server.url + "/api/chat", json={"model": MODEL, "messages": None})
    assert r.status_code == 200 and r.json()["done_reason"] == "load"  # as `ollama run` sends


def test_unknown_model_is_404(client):
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="llama3:70b", prompt="hi")
    assert e.value.status_code == 404 and "llama3:70b" in e.value.error


@pytest.mark.parametrize("stream", [False, True])
def test_durations_and_counts_come_from_the_driver(server, reference, stream):
    """prompt_eval_* is the prefill, eval_* the decode, each measured by the generation driver
    (the same numbers as under `cfr_atlas`), and eval_count is the tokens sampled."""
    r = httpx.post(server.url + "/api/generate", timeout=60, json={
        "model": MODEL, "prompt": LONG, "raw": True, "stream": stream,
        "options": {"num_predict": N}})
    assert r.status_code == 200, r.text
    final = [json.loads(line) for line in r.text.splitlines()][-1]
    text = reference.generate(LONG, max_tokens=N)
    t = reference.last_telemetry
    assert final["done"] and final["eval_count"] == t["generated_tokens"] > 0
    assert final["prompt_eval_count"] == t["prompt_tokens"] > 600  # several prefill chunks
    if not stream:
        assert final["response"] == text
    assert final["prompt_eval_duration"] > 0 and final["eval_duration"] > 0
    assert final["total_duration"] >= final["prompt_eval_duration"] + final["eval_duration"]
    served = final["cfr_atlas"]
    assert final["prompt_eval_duration"] == int(served["prefill_seconds"] * 1e9)
    assert final["eval_duration"] == int(served["decode_seconds"] * 1e9)
    assert served["generated_tokens"] == final["eval_count"]
    assert served["logits_sha256"] == t["logits_sha256"]  # the same steps, bitwise
    assert "page_file_bytes_read" in served
