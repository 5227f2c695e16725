"""Log-probabilities through the official clients: Ollama `logprobs`/`top_logprobs`, OpenAI
chat `logprobs`/`top_logprobs` and completions `logprobs` (+ `echo` for prompt scoring),
streamed and not. Every number equals the log-softmax (float64) of the reference model's raw
logits at that position, compared with ==: the server scores from the exact logits."""

from __future__ import annotations

import numpy as np
import ollama
import openai
import pytest
from serve_support import MODEL

from cfr_atlas.logprobs import log_softmax

N = 6
PROMPT = "The capital of France"


@pytest.fixture(scope="module")
def oclient(server):
    return ollama.Client(host=server.url, timeout=60)


@pytest.fixture(scope="module")
def aclient(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def expected(reference, prompt_ids: list[int], tokens: list[int]) -> np.ndarray:
    """(len(tokens), vocab) float64 log-probabilities of each generated position."""
    rows = reference.logits(prompt_ids + tokens[:-1])[len(prompt_ids) - 1:]
    return np.stack([log_softmax(r) for r in rows])


def _ids(reference, entries) -> list[int]:
    return reference.tokenize("".join(e.token for e in entries))


def test_ollama_generate_logprobs(oclient, reference):
    r = oclient.generate(model=MODEL, prompt=PROMPT, raw=True, logprobs=True, top_logprobs=3,
                         options={"num_predict": N})
    tokens = reference.tokenize(r.response)
    assert "".join(e.token for e in r.logprobs) == r.response
    want = expected(reference, reference.tokenize(PROMPT), tokens)
    for e, row, t in zip(r.logprobs, want, tokens, strict=True):
        assert e.logprob == row[t]
        assert len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token  # greedy
        best = np.argsort(-row, kind="stable")[:3]
        assert [x.logprob for x in e.top_logprobs] == [row[i] for i in best]
    plain = oclient.generate(model=MODEL, prompt=PROMPT, raw=True, options={"num_predict": N})
    assert plain.response == r.response and plain.logprobs is None


def test_ollama_chat_stream_logprobs_match_non_stream(oclient):
    msgs = [{"role": "user", "content": "hello"}]
    whole = oclient.chat(model=MODEL, messages=msgs, logprobs=True, options={"num_predict": N})
    parts = list(oclient.chat(model=MODEL, messages=msgs, logprobs=True, stream=True,
                              options={"num_predict": N}))
    streamed = [e for p in parts for e in (p.logprobs or [])]
    assert [(e.token, e.logprob) for e in streamed] == \
        [(e.token, e.logprob) for e in whole.logprobs]
    assert all(not e.top_logprobs for e in streamed)  # top_logprobs 0: none listed


def test_logprobs_are_the_raw_model_ones_under_a_grammar(oclient, reference):
    """With a format, the chosen token's logprob is the unmasked model's: '{' is unlikely."""
    r = oclient.generate(model=MODEL, prompt=PROMPT, raw=True, format="json", logprobs=True,
                         options={"num_predict": 1})
    first = r.logprobs[0]
    row = log_softmax(reference.next_logits(reference.tokenize(PROMPT)))
    assert first.token == "{" and first.logprob == row[reference.tokenize("{")[0]]
    assert first.logprob < row.max()


def test_openai_chat_logprobs_stream_and_not(aclient, reference):
    msgs = [{"role": "user", "content": "Name a city."}]
    r = aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N,
                                        logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(c.token for c in content) == r.choices[0].message.content
    tokens = reference.tokenize(r.choices[0].message.content)
    want = expected(reference, reference.chat_ids(msgs), tokens)
    assert [c.logprob for c in content] == [row[t] for row, t in zip(want, tokens, strict=True)]
    assert all(len(c.top_logprobs) == 2 and c.bytes == list(c.token.encode()) for c in content)
    chunks = list(aclient.chat.completions.create(model=MODEL, messages=msgs, max_tokens=N,
                                                  logprobs=True, top_logprobs=2, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs
                for c in ch.choices[0].logprobs.content]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_openai_completion_echo_scores_the_prompt(aclient, reference):
    r = aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True,
                                   logprobs=2)
    lp = r.choices[0].logprobs
    ids = reference.tokenize(PROMPT)
    text = r.choices[0].text
    assert "".join(lp.tokens) == text and text.startswith(PROMPT)
    all_ids = reference.tokenize(text)
    rows = reference.logits(all_ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == [log_softmax(rows[i - 1])[all_ids[i]]
                                     for i in range(1, len(all_ids))]
    assert lp.text_offset == [len(reference.detokenize(all_ids[:i])) for i in range(len(all_ids))]
    assert all(len(t) <= 2 for t in lp.top_logprobs[1:])
    assert len(lp.tokens) == len(ids) + 3
    # scoring only: max_tokens 0 gives the prompt's numbers alone
    s = aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                   logprobs=0)
    assert s.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]
    streamed = list(aclient.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                               echo=True, logprobs=2, stream=True))
    assert [t for c in streamed if c.choices[0].logprobs
            for t in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs
