"""The OpenAI API driven by the official `openai` package: greedy output equals the engine's."""

from __future__ import annotations

import numpy as np
import openai
import pytest
from serve_support import MODEL

N = 8


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a city."}]


def test_models(client):
    (m,) = client.models.list().data
    assert m.id == "tiny:latest" and m.owned_by == "cfr-atlas"
    assert client.models.retrieve(MODEL).id == "tiny:latest"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_chat_completion_equals_engine(client, reference):
    expected = reference.generate(reference.chat_ids(MESSAGES), max_tokens=N)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=N,
                                       temperature=0)
    (choice,) = r.choices
    assert choice.message.role == "assistant" and choice.message.content == expected
    assert choice.finish_reason in ("stop", "length")
    n_prompt = len(reference.chat_ids(MESSAGES))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.model_extra["cfr_atlas"]["hot_hit_rate"] >= 0  # our K/V telemetry rides along


def test_chat_completion_stream_with_usage(client, reference):
    expected = reference.generate(reference.chat_ids(MESSAGES), max_tokens=N)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_completion_tokens=N, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] in ("stop", "length") and not any(finals[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0


def test_chat_content_parts(client, reference):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name "},
                                          {"type": "text", "text": "a city."}]}]
    r = client.chat.completions.create(model=MODEL, messages=parts, max_tokens=N)
    expected = reference.generate(
        reference.chat_ids([{"role": "user", "content": "Name a city."}]), max_tokens=N)
    assert r.choices[0].message.content == expected


def test_completions_raw_prompt(client, reference):
    expected = reference.generate("The capital of France", max_tokens=N)
    r = client.completions.create(model=MODEL, prompt="The capital of France", max_tokens=N)
    assert r.choices[0].text == expected and r.object == "text_completion"
    stream = client.completions.create(model=MODEL, prompt="The capital of France",
                                       max_tokens=N, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected
    ids = reference.tokenize("The capital of France")
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=N, echo=True)
    assert by_ids.choices[0].text == "The capital of France" + expected


def test_extensions_via_extra_body(client, reference):
    r = client.completions.create(model=MODEL, prompt="hello world", max_tokens=N,
                                  temperature=0.8, seed=3,
                                  extra_body={"top_k": 10, "repeat_penalty": 1.3})
    assert r.choices[0].text == reference.generate("hello world", max_tokens=N, temperature=0.8,
                                                   seed=3, top_k=10, repeat_penalty=1.3)


def test_embeddings_float_and_base64(client, reference):
    texts = ["hello world", "Paris"]
    as_float = client.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    as_b64 = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64
    for r in (as_float, as_b64):
        assert [d.index for d in r.data] == [0, 1]
        for d, text in zip(r.data, texts, strict=True):
            np.testing.assert_allclose(d.embedding, reference.embedding(text), rtol=1e-6)
    assert as_float.usage.prompt_tokens == sum(len(reference.tokenize(t)) for t in texts)


def test_errors_are_typed(client, reference):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hello world " * 30, max_tokens=2,
                                  extra_body={"num_ctx": 16})
    assert e.value.code == "context_length_exceeded" and "16" in e.value.message
