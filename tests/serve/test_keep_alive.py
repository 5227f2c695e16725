"""Ollama's keep_alive (load, keep, unload with 0; /api/ps shows the expiry), /api/show's
capabilities, and model names with and without `:latest`, through the `ollama` package."""

from __future__ import annotations

from datetime import UTC, datetime

import ollama
import pytest
from serve_support import start_server

from cfr_atlas.engine import load_model


@pytest.fixture(scope="module")
def client(tiny_llama, tmp_path_factory):
    s = start_server(load_model(tiny_llama), tmp_path_factory.mktemp("keep_pages"))
    yield ollama.Client(host=s.url, timeout=60)
    s.stop()


def _expires(client) -> datetime | None:
    models = client.ps().models
    return models[0].expires_at if models else None


def _kept_for(client, call, seconds: float) -> None:
    """After `call()`, /api/ps's expiry is `seconds` after some moment during the call (a
    window, not a fixed slack: a loaded machine may take seconds per request)."""
    t0 = datetime.now(UTC)
    r = call()
    t1 = datetime.now(UTC)
    left_from_start = (_expires(client) - t0).total_seconds()
    left_from_end = (_expires(client) - t1).total_seconds()
    assert left_from_end - 0.01 <= seconds <= left_from_start + 0.01, (t0, t1, seconds)
    return r


def test_load_keep_and_unload(client):
    assert client.generate(model="tiny", prompt="", keep_alive=0).done_reason == "unload"
    assert client.ps().models == []
    r = _kept_for(client, lambda: client.generate(model="tiny:latest", prompt="",
                                                  keep_alive="10m"), 600)
    assert r.done_reason == "load"
    _kept_for(client, lambda: client.generate(model="TINY", prompt="hi", raw=True, keep_alive=30,
                                              options={"num_predict": 2}), 30)  # any case
    client.chat(model="tiny", messages=None, keep_alive=-1)  # forever
    assert _expires(client).year == 9999
    r = client.chat(model="tiny", messages=[{"role": "user", "content": "x"}], keep_alive="0s",
                    options={"num_predict": 1})
    assert r.done and client.ps().models == []  # unloaded once the request is done
    _kept_for(client, lambda: client.embed(model="tiny", input="x", keep_alive="1h"), 3600)


@pytest.mark.parametrize("huge", [1e12, "99999999h"])
def test_keep_alive_beyond_ten_years_is_forever(client, huge):
    """An expiry date past what a date can hold would break /api/ps for every client: a
    keep_alive over ten years means forever, as -1 does."""
    client.generate(model="tiny", prompt="", keep_alive=huge)
    assert _expires(client).year == 9999
    client.generate(model="tiny", prompt="", keep_alive="5m")


def test_bad_keep_alive_is_400(client):
    with pytest.raises(ollama.ResponseError, match="keep_alive") as e:
        client.generate(model="tiny", prompt="", keep_alive="soon")
    assert e.value.status_code == 400


def test_show_capabilities_and_names(client):
    info = client.show("tiny")
    assert info.capabilities == ["completion", "embedding"]  # ChatML: no tool support
    assert client.show("tiny:latest").capabilities == info.capabilities
    with pytest.raises(ollama.ResponseError) as e:
        client.show("tiny:7b")
    assert e.value.status_code == 404
