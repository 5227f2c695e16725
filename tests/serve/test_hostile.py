"""Hostile bodies at every endpoint: whatever a client sends, the answer is < 500 with a JSON
error body (or a normal answer), never a 500, a hang or a dead server.

Hypothesis throws generated JSON (deep, huge integers, NaN, wrong types, huge lists) at every
POST route, raw httpx sends what JSON encoders refuse to write, and the official `ollama` and
`openai` clients send typed-but-absurd values. The server has a 2-token default limit so valid
requests stay cheap.
"""

from __future__ import annotations

import json

import httpx
import ollama
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_support import MODEL, start_server

from cfr_atlas.engine import load_model
from cfr_atlas.serve.http import MAX_DEPTH
from cfr_atlas.serve.params import MAX_EMBED_INPUTS, MAX_STOP_CHARS, MAX_STOPS

POSTS = ["/api/generate", "/api/chat", "/api/embed", "/api/embeddings", "/api/show",
         "/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
MAX_EMBED_TOKENS = 2000


@pytest.fixture(scope="module")
def hostile(tiny_llama, tmp_path_factory):
    s = start_server(load_model(tiny_llama), tmp_path_factory.mktemp("hostile"), max_tokens=2,
                     max_queue=64, max_embed_tokens=MAX_EMBED_TOKENS)
    yield s
    s.stop()


def check(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text[:500]
    if r.status_code >= 400:
        err = r.json()["error"]
        message = err["message"] if isinstance(err, dict) else err
        assert isinstance(message, str) and message
        if r.request.url.path.startswith("/v1/"):
            assert isinstance(err, dict) and err["type"]


def post(server, path, body, **kw) -> httpx.Response:
    """POST `body` (bytes as they are; anything else as JSON, NaN and Infinity included)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, timeout=60, **kw,
                      headers={"content-type": "application/json"})


# --- generated bodies ---------------------------------------------------------------------------

HUGE_INTS = st.sampled_from([10**400, -(10**400), 2**63, -(2**63) - 1, 2**80, 10**4000,
                             2**63 - 1, -1, 0])
SCALARS = (st.none() | st.booleans() | st.integers() | HUGE_INTS
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20))
JSON = st.recursive(SCALARS, lambda c: st.lists(c, max_size=4)
                    | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=12)
SMALL = st.integers(-2, 3)  # num_predict / max_tokens: hostile, or valid and short
VALUE = JSON | HUGE_INTS | st.sampled_from(["1TiB", "lots", "", "\x00", "é" * 300])
OPTION_KEYS = ["temperature", "top_k", "top_p", "min_p", "seed", "repeat_penalty",
               "repeat_last_n", "num_ctx", "stop", "kv_budget", "cache_salt", "dimensions"]
OPTIONS = st.dictionaries(st.sampled_from(OPTION_KEYS), VALUE, max_size=4).map(
    lambda d: {**d, "num_predict": 2})
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "x"])
                                           | VALUE, "content": st.text(max_size=30) | VALUE}),
                    max_size=3) | VALUE


def bodies(path: str):
    base = {"model": st.just(MODEL) | VALUE}
    if path.startswith("/api/"):
        base |= {"prompt": st.text(max_size=30) | VALUE, "messages": MESSAGES,
                 "input": st.lists(st.text(max_size=10), max_size=3) | VALUE,
                 "options": OPTIONS | VALUE, "stream": st.booleans() | VALUE,
                 "raw": st.booleans(), "cache_salt": VALUE, "system": VALUE,
                 "format": VALUE | st.just("json"), "logprobs": VALUE, "top_logprobs": VALUE,
                 "truncate": VALUE, "tools": VALUE}
    else:
        base |= {"prompt": st.text(max_size=30) | st.lists(SMALL) | VALUE, "messages": MESSAGES,
                 "input": st.lists(st.text(max_size=10), max_size=3) | VALUE,
                 "max_tokens": SMALL | HUGE_INTS | VALUE, "stream": st.booleans() | VALUE,
                 "stop": VALUE, "seed": VALUE, "top_k": VALUE, "n": VALUE,
                 "encoding_format": VALUE, "kv_budget": VALUE, "cache_salt": VALUE,
                 "response_format": VALUE, "logprobs": VALUE, "top_logprobs": VALUE,
                 "echo": VALUE, "truncate": VALUE, "tools": VALUE}
    return st.fixed_dictionaries({}, optional=base) | st.dictionaries(st.text(max_size=8), JSON)


def _valid_budget(body: dict) -> bool:
    return not (isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3)


@pytest.mark.parametrize("path", POSTS)
def test_generated_bodies_never_500(hostile, path):
    @settings(max_examples=40, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(bodies(path))
    def run(body):
        if not _valid_budget(body):
            body["max_tokens"] = 2
        check(post(hostile, path, body))

    run()


# --- raw bytes ----------------------------------------------------------------------------------

RAW = {
    "deep arrays": b"[" * 100_000,
    "deep objects": b'{"a":' * 100_000,
    "deep but closed": b'{"model": "tiny", "options": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    "just over the depth limit": b'{"x": ' + b"[" * MAX_DEPTH + b"]" * MAX_DEPTH + b"}",
    "5000-digit integer": b'{"model": "tiny", "options": {"seed": ' + b"9" * 5000 + b"}}",
    "NaN": b'{"model": "tiny", "prompt": "hi", "options": {"temperature": NaN}}',
    "Infinity": b'{"model": "tiny", "prompt": "hi", "max_tokens": Infinity}',
    "bad utf-8 in a string": b'{"model": "tiny", "prompt": "\xff\xfe"}',
    "lone surrogate": b'{"model": "tiny", "prompt": "\\ud800", "raw": true}',
    "nul bytes": b'{"model": "tiny\\u0000", "prompt": "\\u0000"}',
    "truncated": b'{"model": "tiny", "prompt": "hi',
}


@pytest.mark.parametrize("case", list(RAW))
@pytest.mark.parametrize("path", POSTS)
def test_raw_bodies_never_500(hostile, path, case):
    check(post(hostile, path, RAW[case]))


def test_depth_limit_is_exact(hostile):
    ok = b'{"model": "tiny", "x": ' + b"[" * (MAX_DEPTH - 1) + b"]" * (MAX_DEPTH - 1) + b"}"
    assert post(hostile, "/api/show", ok).status_code == 200
    r = post(hostile, "/api/show", RAW["just over the depth limit"])
    assert r.status_code == 400 and f"deeper than {MAX_DEPTH}" in r.json()["error"]


# --- sizes with their limits --------------------------------------------------------------------

def _message(r):
    err = r.json()["error"]
    return err["message"] if isinstance(err, dict) else err


@pytest.mark.parametrize("path, body, phrase", [
    ("/api/generate", {"prompt": "hi", "options": {"num_predict": 10**400}}, "int64"),
    ("/api/generate", {"prompt": "hi", "options": {"seed": 2**80}}, "81-bit"),
    ("/api/generate", {"prompt": "hi", "options": {"top_k": 10**30}}, "top_k"),
    ("/api/generate", {"prompt": "hi", "options": {"temperature": 10**400}}, "temperature"),
    ("/api/generate", {"prompt": "hi", "options": {"stop": ["x"] * (MAX_STOPS + 1)}},
     f"at most {MAX_STOPS}"),
    ("/api/generate", {"prompt": "hi", "options": {"stop": "x" * (MAX_STOP_CHARS + 1)}},
     f"at most {MAX_STOP_CHARS} characters"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stop": ["s"] * 10_000}, "10000 strings"),
    ("/v1/completions", {"prompt": [10**30]}, "token ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "seed": -(10**100)}, "seed"),
    ("/api/embed", {"input": ["a"] * (MAX_EMBED_INPUTS + 1)}, f"at most {MAX_EMBED_INPUTS}"),
    ("/v1/embeddings", {"input": ["word " * 300] * 3}, f"limit of {MAX_EMBED_TOKENS}"),
    ("/v1/embeddings", {"input": [[1] * 1500, [2] * 1500]}, f"limit of {MAX_EMBED_TOKENS}"),
    ("/api/embed", {"input": "hi", "dimensions": 10**400}, "dimensions"),
])
def test_sizes_and_huge_numbers_are_400s(hostile, path, body, phrase):
    r = post(hostile, path, {"model": MODEL, "stream": False, **body})
    assert r.status_code == 400 and phrase in _message(r), r.text[:300]
    assert len(r.content) < 2000  # the message does not echo the megabytes it was sent


# --- the official clients -----------------------------------------------------------------------

@pytest.mark.parametrize("options", [{"num_predict": 10**400}, {"seed": 2**80},
                                     {"top_k": 2**70}, {"stop": ["a"] * 100},
                                     {"temperature": 1e308 * 10}, {"kv_budget": [1]}])
def test_ollama_client_gets_400s(hostile, options):
    client = ollama.Client(host=hostile.url, timeout=60)
    for call in (lambda: client.generate(model=MODEL, prompt="hi", options=options),
                 lambda: client.chat(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                     options=options)):
        try:
            call()
        except ollama.ResponseError as e:
            assert e.status_code == 400 and e.error
        except ValueError:  # the client refused to encode it (e.g. inf): nothing was sent
            pass
        else:
            raise AssertionError(f"{options} was accepted")


@pytest.mark.parametrize("kw", [{"max_tokens": 10**400}, {"seed": 2**80},
                                {"stop": ["a"] * 100}, {"extra_body": {"top_k": 10**30}},
                                {"extra_body": {"cache_salt": "x" * 10_000}},
                                {"extra_body": {"kv_budget": {"a": [[[]]]}}}])
def test_openai_client_gets_400s(hostile, kw):
    ai = openai.OpenAI(base_url=hostile.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        ai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                   **kw)
    assert e.value.status_code == 400
    with pytest.raises(openai.BadRequestError):
        ai.completions.create(model=MODEL, prompt="hi", **kw)


def test_openai_embeddings_too_many_inputs(hostile):
    ai = openai.OpenAI(base_url=hostile.url + "/v1", api_key="x", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match=str(MAX_EMBED_INPUTS)):
        ai.embeddings.create(model=MODEL, input=["a"] * (MAX_EMBED_INPUTS + 1),
                             encoding_format="float")


def test_the_server_lives_on_and_never_answered_500(hostile):
    r = post(hostile, "/api/generate", {"model": MODEL, "prompt": "hi", "stream": False})
    assert r.status_code == 200 and r.json()["eval_count"] <= 2
    metrics = httpx.get(hostile.url + "/metrics").text
    assert 'status="500"' not in metrics, [x for x in metrics.splitlines() if "500" in x]
    hostile.wait_for(lambda st: st.active == 0 and st.queued == 0, what="idle")
