"""`cfr_atlas.ollama`: the typed client against our server, and its error mapping offline."""

from __future__ import annotations

import socket

import httpx
import numpy as np
import pytest
from serve_support import MODEL

from cfr_atlas.errors import (
    ApiBadRequestError,
    ApiBusyError,
    ApiConnectionError,
    ApiError,
    ApiNotFoundError,
    ApiServerError,
    ConfigError,
    ExactKvUnavailableError,
)
from cfr_atlas.ollama import OllamaClient, Topology, normalize_host

N = 6


@pytest.mark.parametrize("given, expected", [
    ("localhost", "http://localhost:11434"),
    ("127.0.0.1:8080", "http://127.0.0.1:8080"),
    (":9000", "http://127.0.0.1:9000"),
    ("0.0.0.0", "http://127.0.0.1:11434"),
    ("http://example.com", "http://example.com:11434"),
    ("https://example.com/", "https://example.com:443"),
    ("https://example.com:8443/api/", "https://example.com:8443"),
    ("http://example.com/ollama/", "http://example.com:11434/ollama"),
    ("[::1]:7000", "http://[::1]:7000"),
    ("  http://h:1  ", "http://h:1"),
])
def test_normalize_host(given, expected):
    assert normalize_host(given) == expected


def test_normalize_host_env_and_errors(monkeypatch):
    monkeypatch.setenv("OLLAMA_HOST", "remote:1234")
    assert normalize_host(None) == "http://remote:1234"
    for bad in ("ftp://x", "http://x:notaport"):
        with pytest.raises(ConfigError):
            normalize_host(bad)


@pytest.fixture(scope="module")
def client(server):
    with OllamaClient(server.url) as c:
        yield c


def test_list_show_topology(client, reference):
    (m,) = client.list()
    assert m.name == "tiny:latest" and m.details["family"] == "llama"
    shown = client.show(MODEL)
    cfg = reference.config
    t = shown.topology
    assert (t.arch, t.n_layers, t.dim, t.n_heads, t.n_kv_heads, t.head_dim, t.hidden_dim,
            t.context_length) == ("llama", cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads,
                                  cfg.head_dim, cfg.hidden_dim, cfg.context_length)
    assert t.kv_bytes_per_token(4) == cfg.kv_bytes_per_token(4)
    assert client.version()


def test_topology_needs_the_core_keys():
    assert Topology.from_model_info({}) is None
    assert Topology.from_model_info({"general.architecture": "llama"}) is None
    t = Topology.from_model_info({"general.architecture": "qwen2", "qwen2.block_count": 24,
                                  "qwen2.embedding_length": 896,
                                  "qwen2.attention.head_count": 14})
    assert (t.n_kv_heads, t.head_dim, t.context_length) == (14, 64, None)


def test_generate_chat_embed(client, reference):
    prompt = reference.chat_ids([{"role": "user", "content": "hello"}])
    expected = reference.generate(prompt, max_tokens=N)
    done = client.generate(MODEL, "hello", options={"num_predict": N})
    assert done.text == expected and done.stats.eval_count > 0
    assert done.stats.tokens_per_second > 0 and "peak_resident_kv_bytes" in done.stats.extra
    chunks = list(client.generate_stream(MODEL, "hello", options={"num_predict": N}))
    assert "".join(c.text for c in chunks) == expected
    assert chunks[-1].done and chunks[-1].stats.done_reason in ("stop", "length")
    messages = [{"role": "user", "content": "hello"}]
    assert client.chat(MODEL, messages, options={"num_predict": N}).text == expected
    assert "".join(c.text for c in client.chat_stream(
        MODEL, messages, options={"num_predict": N})) == expected
    raw = client.generate(MODEL, "The capital", raw=True, options={"num_predict": N})
    assert raw.text == reference.generate("The capital", max_tokens=N)
    e = client.embed(MODEL, ["Paris", "hello world"])
    np.testing.assert_allclose(e.vectors[1], reference.embedding("hello world"), rtol=1e-6)
    assert e.prompt_eval_count == 3 and len(client.embed(MODEL, "x", dimensions=4).vectors[0]) == 4


def test_server_errors_are_typed(client):
    with pytest.raises(ApiNotFoundError, match="not found") as e:
        client.generate("nope", "hi")
    assert e.value.status == 404
    with pytest.raises(ApiBadRequestError, match="num_predict"):
        client.generate(MODEL, "hi", options={"num_predict": -3})
    with pytest.raises(ApiBadRequestError, match="messages"):  # ([] loads the model, as Ollama)
        list(client.chat_stream(MODEL, [{"role": "wizard", "content": "x"}]))
    with pytest.raises(ExactKvUnavailableError, match="in-process"):
        client.exact_kv(MODEL, layer=0)


def test_unreachable_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        with OllamaClient(f"127.0.0.1:{port}", timeout=5) as c, \
                pytest.raises(ApiConnectionError):
            c.list()


def _mocked(handler) -> OllamaClient:
    return OllamaClient("http://mock", transport=httpx.MockTransport(handler))


def test_error_mapping_offline():
    busy = _mocked(lambda r: httpx.Response(429, json={"error": "full"},
                                            headers={"Retry-After": "3"}))
    with pytest.raises(ApiBusyError) as e:
        busy.list()
    assert e.value.retry_after == 3.0 and e.value.message == "full"
    broken = _mocked(lambda r: httpx.Response(500, text="boom"))
    with pytest.raises(ApiServerError, match="boom"):
        broken.version()
    openai_shaped = _mocked(lambda r: httpx.Response(
        400, json={"error": {"message": "bad temperature", "type": "invalid_request_error"}}))
    with pytest.raises(ApiBadRequestError, match="bad temperature"):
        openai_shaped.version()
    mid_stream = _mocked(lambda r: httpx.Response(
        200, content=b'{"response": "a", "done": false}\n{"error": "page corrupt"}\n'))
    chunks = mid_stream.generate_stream("m", "p")
    assert next(chunks).text == "a"
    with pytest.raises(ApiError, match="page corrupt"):
        next(chunks)
