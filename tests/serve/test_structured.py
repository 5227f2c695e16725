"""Structured output through the official clients: Ollama `format` and OpenAI
`response_format`, generation constrained by llguidance's token mask.

Every response of the tiny model (random weights, temperature 1: the mask does all the work)
parses and validates against its schema; the logits the sampler received stay bitwise the
unconstrained model's (checked against a teacher-forced pass with np.array_equal); a
constrained request batched with others answers exactly as alone.
"""

from __future__ import annotations

import hashlib
import json
import threading

import httpx
import jsonschema
import numpy as np
import ollama
import openai
import pytest
from serve_support import MODEL

from cfr_atlas.generate import Generation
from cfr_atlas.sampling import SamplingParams
from cfr_atlas.text.grammar import TokenGrammar

S = {"type": "string", "maxLength": 12}  # bounded: random weights would babble on
SCHEMAS = [
    {"type": "object", "properties": {"name": S, "age": {"type": "integer", "minimum": 0,
                                                          "maximum": 150}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": S, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "gr\"een", "b\\lue", "new\nline"]}},
     "required": ["color"], "additionalProperties": False},
    {"type": "object", "properties": {
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9,
                                                         "maximum": 9},
                                                   "y": {"enum": [0.5, -1e3, 2]}},
                  "required": ["x", "y"], "additionalProperties": False},
        "ok": {"type": "boolean"}}, "required": ["point", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9},
                                         "label": S}, "required": ["id", "label"],
        "additionalProperties": False}}}, "required": ["items"], "additionalProperties": False},
    {"type": "object", "properties": {"quote": {"type": "string", "maxLength": 6,
                                                "pattern": "^[a-z\"\\\\]*$"},
                                      "n": {"type": ["integer", "null"], "maximum": 99,
                                            "minimum": -99}},
     "required": ["quote", "n"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2.5, "x", None, True]}, "minItems": 1,
     "maxItems": 4},
    {"type": "object", "properties": {"a": {"const": "tab\there"}, "b": S},
     "required": ["a"], "additionalProperties": False},
]
N = 200  # tokens at most; every schema above completes well within (asserted: done "stop")


@pytest.fixture(scope="module")
def oclient(server):
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def _options(seed: int) -> dict:
    return {"temperature": 1.0, "seed": seed, "num_predict": N}


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_ollama_format_schema_validates(oclient, i):
    schema = SCHEMAS[i]
    r = oclient.chat(model=MODEL, messages=[{"role": "user", "content": "JSON please"}],
                     format=schema, options=_options(1))
    assert r.done_reason == "stop", r.message.content
    jsonschema.validate(json.loads(r.message.content), schema)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_openai_json_schema_validates(aclient, i):
    schema = SCHEMAS[i]
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    r = aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                        response_format=fmt, max_tokens=N, temperature=1.0,
                                        seed=3)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_json_mode_both_apis_and_streaming(oclient, aclient):
    """"json" / json_object: a JSON object from the first token on, streamed too (random
    weights need not close it within a few tokens: the shape is what is checked here)."""
    chunks = list(oclient.generate(model=MODEL, prompt="x", format="json", stream=True,
                                   options={**_options(4), "num_predict": 6}))
    assert "".join(c.response for c in chunks).startswith("{") and chunks[-1].done
    free = oclient.generate(model=MODEL, prompt="x", options={**_options(4), "num_predict": 6})
    assert not free.response.startswith("{")  # so the mask, not luck, opened the object
    r = aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                        response_format={"type": "json_object"}, max_tokens=4)
    assert r.choices[0].message.content.startswith("{")


@pytest.mark.parametrize("body", [{"format": "yaml"}, {"format": 3},
                                  {"format": {"type": "object", "properties": 7}}])
def test_bad_format_is_400(server, body):
    r = httpx.post(server.url + "/api/generate", json={"model": MODEL, "prompt": "x", **body})
    assert r.status_code == 400 and "format" in r.json()["error"], r.text


def test_bad_response_format_is_400(aclient):
    for fmt in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "t"}}):
        with pytest.raises(openai.BadRequestError, match="response_format"):
            aclient.chat.completions.create(model=MODEL, response_format=fmt,
                                            messages=[{"role": "user", "content": "x"}])


def test_unmasked_logits_are_bitwise_unconstrained(reference):
    """The constrained run's logits (what its events carry and its fingerprint hashes) equal,
    row by row, those of an unconstrained pass over the same tokens."""
    grammar = TokenGrammar(reference.tokenizer)
    prompt = reference.chat_ids([{"role": "user", "content": "JSON please"}])
    session = reference.session()
    try:
        run = Generation(reference.net, session, prompt, SamplingParams(temperature=1.0, seed=5),
                         max_tokens=N, tokenizer=reference.tokenizer,
                         constraint=grammar.constraint(SCHEMAS[4]))
        events = [e for e in run.events() if e.token is not None]
    finally:
        session.close()
    tokens = [e.token for e in events]
    assert run.finish_reason == "stop" and len(tokens) > 10
    jsonschema.validate(json.loads(reference.detokenize(tokens[:-1])), SCHEMAS[4])
    forced = reference.logits(prompt + tokens[:-1])[len(prompt) - 1:]
    assert len(forced) == len(events)
    for row, event in zip(forced, events, strict=True):
        assert np.array_equal(row, event.logits)
    digest = hashlib.sha256(b"".join(e.logits.tobytes() for e in events)).hexdigest()
    assert run.telemetry()["logits_sha256"] == digest
    # and the mask really steered: unconstrained, the same seed gives something else
    free = reference.generate(prompt, max_tokens=len(tokens), temperature=1.0, seed=5)
    assert free != reference.detokenize(tokens[:-1])


def _ask(url: str, i: int, constrained: bool) -> str:
    body = {"model": MODEL, "stream": False, "messages": [{"role": "user", "content": str(i)}],
            "options": _options(10 + i)}
    if constrained:
        body["format"] = SCHEMAS[i]
    return httpx.post(url + "/api/chat", json=body, timeout=120).json()["message"]["content"]


def test_constrained_requests_batched_equal_alone(server):
    cases = [(0, True), (1, False), (4, True), (2, True), (3, False)]
    alone = [_ask(server.url, i, c) for i, c in cases]
    got: dict[int, str] = {}
    server.service.scheduler.hold(True)
    threads = [threading.Thread(target=lambda k=k: got.__setitem__(k, _ask(server.url, *cases[k])))
               for k in range(len(cases))]
    for t in threads:
        t.start()
    try:
        server.wait_for(lambda s: s.queued == len(cases), what="every request queued")
    finally:
        server.service.scheduler.hold(False)
    for t in threads:
        t.join(120)
    assert [got.get(k) for k in range(len(cases))] == alone
    for (i, constrained), text in zip(cases, alone, strict=True):
        if constrained:
            jsonschema.validate(json.loads(text), SCHEMAS[i])
