"""Engine failures inside a request: an error line mid-stream, a 500 with the message before
it, the sequence released, and the server serving the next request."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from serve_support import MODEL, start_server

from cfr_atlas.engine import load_model
from cfr_atlas.errors import RegeneratorError


@pytest.fixture(scope="module")
def flaky(tiny_llama, tmp_path_factory):
    """A server whose model raises `plan["error"]` from batched pass number `plan["at"]`."""
    model = load_model(tiny_llama)
    real, plan = model.net.forward_batch, {"at": None, "calls": 0, "error": None}

    def forward_batch(items):
        plan["calls"] += 1
        if plan["at"] is not None and plan["calls"] >= plan["at"]:
            raise plan["error"]
        return real(items)

    model.net.forward_batch = forward_batch
    server = start_server(model, tmp_path_factory.mktemp("flaky"))
    yield server, plan
    server.stop()


def _arm(plan, after_calls, error):
    plan.update(at=plan["calls"] + after_calls, error=error)


def test_error_mid_stream_is_the_last_line(flaky):
    server, plan = flaky
    _arm(plan, 4, RegeneratorError("L0/H1/p0", "page file vanished"))  # prefill + 2 passes ok
    body = {"model": MODEL, "prompt": "hello", "raw": True, "options": {"num_predict": 50}}
    with httpx.stream("POST", server.url + "/api/generate", json=body, timeout=30) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert r.status_code == 200
    assert lines[-1]["error"].endswith("page file vanished")
    assert not any(line.get("done") for line in lines)
    stats = server.wait_for(lambda s: s.active == 0, what="release")
    assert stats.failed == 1


def test_bug_mid_stream_is_a_generic_last_line(flaky):
    server, plan = flaky
    _arm(plan, 4, ValueError("internal detail 0xdeadbeef"))
    body = {"model": MODEL, "prompt": "hello", "raw": True, "options": {"num_predict": 50}}
    with httpx.stream("POST", server.url + "/api/generate", json=body, timeout=30) as r:
        lines = [json.loads(line) for line in r.iter_lines() if line]
    assert "request id" in lines[-1]["error"] and "deadbeef" not in lines[-1]["error"]
    server.wait_for(lambda s: s.active == 0, what="release")
    plan["at"] = None


def test_bug_before_first_token_is_a_generic_500_and_the_server_lives_on(flaky, caplog):
    server, plan = flaky
    _arm(plan, 0, RuntimeError("a bug at /secret/path"))
    with caplog.at_level(logging.ERROR, logger="cfr_atlas.serve"):
        r = httpx.post(server.url + "/v1/completions", timeout=30,
                       json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    message = r.json()["error"]["message"]
    request_id = r.headers["x-request-id"]
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert "secret" not in message and "a bug" not in message and request_id in message
    logged = [rec for rec in caplog.records if request_id in rec.getMessage()]
    assert logged and "a bug at /secret/path" in str(logged[0].exc_info[1])
    plan["at"] = None
    r = httpx.post(server.url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": "hello", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"]
