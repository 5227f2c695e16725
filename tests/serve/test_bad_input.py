"""Bad requests get a 4xx with a JSON message naming the problem: never a 500, a hang or a
dead server."""

from __future__ import annotations

import httpx
import pytest
from serve_support import MODEL

CHAT = [{"role": "user", "content": "hi"}]
LONG = "hello world " * 3000  # ~6000 tokens > the tiny model's 4096


def ollama_gen(**kw):
    return ("/api/generate", {"model": MODEL, "prompt": "hi", "stream": False, **kw})


def ollama_chat(**kw):
    return ("/api/chat", {"model": MODEL, "messages": CHAT, "stream": False, **kw})


def oai_chat(**kw):
    return ("/v1/chat/completions", {"model": MODEL, "messages": CHAT, **kw})


CASES = {
    # (path, json body) -> (status, a phrase the message must contain)
    "missing model": (("/api/generate", {"prompt": "hi"}), 400, "model"),
    "unknown model": (ollama_gen(model="nope"), 404, "nope"),
    "unknown model chat": (ollama_chat(model="nope:7b"), 404, "nope:7b"),
    "unknown model openai": (oai_chat(model="gpt-4"), 404, "gpt-4"),
    "prompt not a string": (ollama_gen(prompt=42), 400, "prompt"),
    "stream not a bool": (ollama_gen(stream="yes"), 400, "stream"),
    "options not an object": (ollama_gen(options=[1]), 400, "options"),
    "temperature a string": (ollama_gen(options={"temperature": "hot"}), 400,
                             "options.temperature"),
    "temperature negative": (ollama_gen(options={"temperature": -1}), 400, "temperature"),
    "top_p zero": (ollama_gen(options={"top_p": 0}), 400, "top_p"),
    "top_k fractional": (ollama_gen(options={"top_k": 2.5}), 400, "top_k"),
    "negative num_predict": (ollama_gen(options={"num_predict": -5}), 400, "num_predict"),
    "num_predict bool": (ollama_gen(options={"num_predict": True}), 400, "num_predict"),
    "absurd num_ctx": (ollama_gen(options={"num_ctx": 10**9}), 400, "4096"),
    "zero num_ctx": (ollama_gen(options={"num_ctx": 0}), 400, "num_ctx"),
    "stop not strings": (ollama_gen(options={"stop": [1, 2]}), 400, "stop"),
    "bad kv_budget": (ollama_gen(options={"kv_budget": "lots"}), 400, "kv_budget"),
    "kv_budget below scratch": (ollama_gen(options={"kv_budget": "1KiB"}), 400, "scratch"),
    "kv_budget 0%": (ollama_gen(options={"kv_budget": "0%"}), 400, "options.kv_budget"),
    "kv_budget over 100%": (oai_chat(kv_budget="150%"), 400, "e.g. 10%"),
    "kv_budget percent below scratch": (ollama_gen(options={"kv_budget": "0.001%"}), 400,
                                        "scratch"),
    "kv_budget below scratch, streaming": (
        ollama_gen(stream=True, options={"kv_budget": 1024}), 400, "scratch"),
    "prompt too long": (ollama_gen(prompt=LONG, raw=True), 400, "4096"),
    "prompt too long, streaming": (ollama_gen(prompt=LONG, stream=True), 400, "4096"),
    "prompt over num_ctx": (ollama_gen(prompt="hello world " * 20, raw=True,
                                       options={"num_ctx": 8}), 400, "limit of 8"),
    "images": (ollama_gen(images=["aGk="]), 400, "images"),
    "format yaml": (ollama_gen(format="yaml"), 400, "format"),
    "format a bad schema": (ollama_gen(format={"type": "object", "required": 5}), 400,
                            "format"),
    "top_logprobs without logprobs": (ollama_gen(top_logprobs=3), 400, "logprobs"),
    "top_logprobs over 20": (oai_chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    "completion logprobs over 5": (("/v1/completions", {"model": MODEL, "prompt": "a",
                                                        "logprobs": 6}), 400, "logprobs"),
    "response_format type": (oai_chat(response_format={"type": "yaml"}), 400,
                             "response_format"),
    "messages not a list": (ollama_chat(messages="hi"), 400, "messages"),
    "message without role": (ollama_chat(messages=[{"content": "hi"}]), 400, "role"),
    "unknown role": (ollama_chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "role"),
    "content a number": (ollama_chat(messages=[{"role": "user", "content": 5}]), 400,
                         "content"),
    "embed empty list": (("/api/embed", {"model": MODEL, "input": []}), 400, "input"),
    "embed empty string": (("/api/embed", {"model": MODEL, "input": [""]}), 400, "empty"),
    "embed too long": (("/api/embed", {"model": MODEL, "input": LONG}), 400, "4096"),
    "embed dimensions": (("/api/embed", {"model": MODEL, "input": "a", "dimensions": 0}), 400,
                         "dimensions"),
    "openai empty messages": (oai_chat(messages=[]), 400, "messages"),
    "openai negative max_tokens": (oai_chat(max_tokens=-1), 400, "max_tokens"),
    "openai image part": (oai_chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), 400, "image_url"),
    "openai presence penalty": (oai_chat(presence_penalty=0.5), 400, "presence_penalty"),
    "openai too long": (("/v1/completions", {"model": MODEL, "prompt": LONG}), 400, "4096"),
    "openai empty prompt": (("/v1/completions", {"model": MODEL, "prompt": ""}), 400, "empty"),
    "openai two prompts": (("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}), 400,
                           "one prompt"),
    "openai token out of vocab": (("/v1/completions", {"model": MODEL, "prompt": [10**6]}), 400,
                                  "ids"),
    "openai embedding format": (("/v1/embeddings", {"model": MODEL, "input": "a",
                                                    "encoding_format": "int8"}), 400,
                                "encoding_format"),
}


def _message(body) -> str:
    err = body["error"]
    return err["message"] if isinstance(err, dict) else err


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request_is_a_4xx_with_a_message(server, case):
    (path, body), status, phrase = CASES[case]
    r = httpx.post(server.url + path, json=body, timeout=30)
    assert r.status_code == status, r.text
    assert phrase in _message(r.json())
    if path.startswith("/v1/"):
        assert r.json()["error"]["type"] in ("invalid_request_error", "not_found_error")


@pytest.mark.parametrize("content", [b"{not json", b"", b"[1, 2]", b"\xff\xfe", b"null"])
@pytest.mark.parametrize("path", ["/api/generate", "/api/chat", "/api/embed",
                                  "/v1/chat/completions", "/v1/embeddings"])
def test_malformed_bodies(server, path, content):
    r = httpx.post(server.url + path, content=content, timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "body" in _message(r.json())


def test_routing_errors_are_json(server):
    r = httpx.get(server.url + "/api/nothing")
    assert r.status_code == 404 and "Not Found" in r.json()["error"]
    r = httpx.get(server.url + "/api/chat")
    assert r.status_code == 405 and r.json()["error"]
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"]


def test_body_size_limit(busy_server):
    r = httpx.post(busy_server.url + "/api/generate", timeout=30,
                   json={"model": MODEL, "prompt": "x" * 5000})
    assert r.status_code == 400 and "4096-byte limit" in r.json()["error"]


def test_server_survives_and_never_answered_500(server):
    r = httpx.post(server.url + "/api/generate", timeout=30, json={
        "model": MODEL, "prompt": "hi", "stream": False, "options": {"num_predict": 2}})
    assert r.status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    assert 'status="500"' not in metrics
    assert server.stats().active == 0
