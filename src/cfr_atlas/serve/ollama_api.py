"""Ollama's API: /api/version, tags, show, ps, generate, chat, embed and the older embeddings.

Responses carry Ollama's fields; durations are nanoseconds, measured: `total_duration` is the
wall time from the request to the last byte's worth of work (queue wait included),
`prompt_eval_duration` and `eval_duration` the worker's time on this sequence's prefill and
decode steps as the generation driver measured them (`Outcome`), `load_duration` 0 (the
model stays loaded). `prompt_eval_cached_count` counts prompt tokens mapped from the prefix
cache instead of recomputed. The final object also carries our K/V telemetry under
`cfr_atlas`.
`format` constrains generation to JSON (a schema or any object), `logprobs` come from the raw
logits, `tools` on /api/chat are rendered by the model's template and parsed back into
`message.tool_calls`, `keep_alive` sets what /api/ps reports.
Request validation lives in `params`, error shapes and streaming in `http`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cfr_atlas.errors import ConfigError
from cfr_atlas.serve.card import rfc3339
from cfr_atlas.serve.http import endpoint, ndjson, ollama_error, read_json, stream, until_done
from cfr_atlas.serve.params import (
    chat_messages,
    embed_inputs,
    get_bool,
    get_dimensions,
    get_object,
    get_str,
    get_tools,
    keep_alive,
    kv_budget,
    ollama_options,
    ollama_salt,
    refuse,
)
from cfr_atlas.serve.service import Handle, Service, shrink
from cfr_atlas.text.tools import ToolText, parse_tool_calls

API_VERSION = "0.6.0"  # the Ollama release whose endpoints and fields this module follows
_UNSUPPORTED = (("images", "the model reads text only"),
                ("suffix", "no fill-in-the-middle"),
                ("template", "the GGUF's own chat template is always used"),
                ("context", "deprecated upstream; send the conversation to /api/chat"))


def _service(request: Request) -> Service:
    return request.app.state.service


def _now() -> str:
    return rfc3339(datetime.now(UTC))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def done_fields(handle: Handle, outcome) -> dict:
    return {"done": True, "done_reason": outcome.done_reason,
            "total_duration": handle.elapsed_ns(), "load_duration": 0,
            "prompt_eval_count": outcome.prompt_tokens,
            "prompt_eval_cached_count": outcome.telemetry.get("prompt_cached_tokens", 0),
            "prompt_eval_duration": _ns(outcome.prompt_seconds),
            "eval_count": outcome.eval_count, "eval_duration": _ns(outcome.eval_seconds),
            "cfr_atlas": {**outcome.telemetry, "queue_seconds": outcome.queue_seconds}}


def _logprob(service: Service, scored) -> dict:
    """Ollama's shape: {"token", "logprob", "bytes", "top_logprobs": [...]}."""
    def entry(token: int, logprob: float) -> dict:
        return {"token": service.token_text(token), "logprob": logprob,
                "bytes": list(service.token_bytes(token))}
    return {**entry(scored.token, scored.logprob),
            "top_logprobs": [entry(t, lp) for t, lp in scored.top]}


def _calls(calls) -> dict:
    """Ollama's tool calls: arguments as objects."""
    if not calls:
        return {}
    return {"tool_calls": [{"function": {"name": c.name, "arguments": c.arguments}}
                           for c in calls]}


def _names(tools: list[dict] | None) -> list[str] | None:
    return None if tools is None else [t["function"]["name"] for t in tools]


def _chat_wrap(text: str, calls=()) -> dict:
    return {"message": {"role": "assistant", "content": text, **_calls(calls)}}


async def _respond(request: Request, handle: Handle, name: str, streaming: bool, wrap,
                   logprobs: bool = False, tools: list[str] | None = None):
    """One JSON object, or NDJSON: a line per text piece, then the final line with stats.
    With `logprobs`, each object carries the entries of the tokens its text came from; with
    `tools` (chat: the tools' names), `<tool_call>` blocks become `message.tool_calls`
    (streamed: in one line before the final one)."""
    service = _service(request)
    if not streaming:
        text, outcome = await until_done(request, handle, handle.result())
        extra = {"logprobs": [_logprob(service, s) for s in outcome.logprobs]} if logprobs \
            else {}
        body = _chat_wrap(*parse_tool_calls(text, tools)) if tools else wrap(text)
        return JSONResponse({"model": name, "created_at": _now(), **body, **extra,
                             **done_fields(handle, outcome)})
    pending: list = []
    calls = ToolText(tools) if tools else None

    def scores() -> dict:
        if not logprobs:
            return {}
        out = [_logprob(service, s) for s in pending]
        pending.clear()
        return {"logprobs": out}

    def render(kind: str, value) -> bytes:
        head = {"model": name, "created_at": _now()}
        if kind == "logprobs":
            pending.extend(value)
            return b""
        if kind == "text":
            text = value if calls is None else calls.push(value)
            return ndjson({**head, **wrap(text), **scores(), "done": False}) if text else b""
        if kind != "done":
            return b""
        out = b""
        if calls is not None:
            rest, found = calls.finish()
            if rest or found:
                out = ndjson({**head, **_chat_wrap(rest, found), "done": False})
        return out + ndjson({**head, **wrap(""), **scores(), **done_fields(handle, value)})

    return await stream(request, handle, render, lambda e: ndjson({"error": str(e)}),
                        "application/x-ndjson")


async def _request(request: Request, keep: bool = True) -> tuple[Service, dict, str]:
    """The service, the JSON body and the resolved model name ("model", or legacy "name");
    with `keep`, the request's `keep_alive` is applied."""
    service = _service(request)
    body = await read_json(request, service.config.max_body_bytes)
    name = get_str(body, "model", None) or get_str(body, "name", None)
    if not name:
        raise ConfigError("model", "is required")
    name = service.card.resolve(name)
    if keep:
        service.keep(keep_alive(body))
    return service, body, name


def _loaded(service: Service, body: Mapping) -> str:
    """done_reason of a request that only loads (or, with keep_alive 0, unloads)."""
    return "unload" if keep_alive(body) == 0 else "load"


@endpoint(ollama_error)
async def generate(request: Request) -> Response:
    service, body, name = await _request(request)
    for key, why in _UNSUPPORTED:
        refuse(body, key, why)
    prompt = get_str(body, "prompt", "")
    streaming = get_bool(body, "stream", True)
    raw = get_bool(body, "raw", False)
    system = get_str(body, "system", "")
    opts = ollama_options(body, service.context_length)
    if not prompt:  # Ollama's way to (pre)load a model
        return JSONResponse({"model": name, "created_at": _now(), "response": "",
                             "done": True, "done_reason": _loaded(service, body)})
    if raw:  # the client's own template: control-token text is parsed (docs/SERVING.md)
        ids = service.tokenize(prompt, special=True)
    else:
        messages = ([{"role": "system", "content": system}] if system else [])
        ids = service.chat_ids(messages + [{"role": "user", "content": prompt}])
    handle = service.start_generation(ids, opts)
    return await _respond(request, handle, name, streaming, lambda text: {"response": text},
                          opts.logprobs is not None)


@endpoint(ollama_error)
async def chat(request: Request) -> Response:
    service, body, name = await _request(request)
    for key, why in [u for u in _UNSUPPORTED if u[0] != "images"]:
        refuse(body, key, why)
    streaming = get_bool(body, "stream", True)
    opts = ollama_options(body, service.context_length)
    if body.get("messages") in (None, []):  # a load / unload (keep_alive 0) request, as
        # Ollama: `ollama run` sends messages null, the `ollama` package's chat() sends []
        return JSONResponse({"model": name, "created_at": _now(), "done": True,
                             "message": {"role": "assistant", "content": ""},
                             "done_reason": _loaded(service, body)})
    messages = chat_messages(body)
    tools = get_tools(body)
    handle = service.start_generation(service.chat_ids(messages, tools), opts)
    return await _respond(request, handle, name, streaming, _chat_wrap,
                          opts.logprobs is not None, _names(tools))


@endpoint(ollama_error)
async def embed(request: Request) -> Response:
    service, body, name = await _request(request)
    inputs = embed_inputs(body, "input", token_ids=False)
    get_bool(body, "truncate", True)  # accepted, but a too-long input is always a 400
    budget = kv_budget(get_object(body, "options"), "options.")
    dims = get_dimensions(body, service.model.config.dim)
    handle = service.start_embedding(inputs, budget, ollama_salt(body))
    _, outcome = await until_done(request, handle, handle.result())
    return JSONResponse({"model": name, "embeddings": [shrink(v, dims) for v in outcome.vectors],
                         "total_duration": handle.elapsed_ns(), "load_duration": 0,
                         "prompt_eval_count": outcome.prompt_tokens})


@endpoint(ollama_error)
async def embeddings(request: Request) -> Response:
    """The older single-prompt endpoint: {"model", "prompt"} -> {"embedding": [...]}."""
    service, body, _ = await _request(request)
    prompt = get_str(body, "prompt", "")
    budget = kv_budget(get_object(body, "options"), "options.")
    salt = ollama_salt(body)
    if not prompt:
        return JSONResponse({"embedding": []})
    handle = service.start_embedding([prompt], budget, salt)
    _, outcome = await until_done(request, handle, handle.result())
    return JSONResponse({"embedding": outcome.vectors[0].tolist()})


@endpoint(ollama_error)
async def show(request: Request) -> Response:
    service, body, _ = await _request(request, keep=False)
    card = service.card
    capabilities = ["completion", *(["tools"] if service.supports_tools else []), "embedding"]
    return JSONResponse({
        "license": str(card.metadata.get("general.license", "")),
        "modelfile": f"# served by cfr-atlas\nFROM {card.path}\n",
        "parameters": "", "template": card.template, "details": card.details,
        "model_info": card.model_info(get_bool(body, "verbose", False)),
        "capabilities": capabilities, "modified_at": card.modified_at})


@endpoint(ollama_error)
async def tags(request: Request) -> Response:
    return JSONResponse({"models": [_service(request).card.summary()]})


@endpoint(ollama_error)
async def ps(request: Request) -> Response:
    service = _service(request)
    s = service.scheduler.stats()
    if not service.loaded:
        return JSONResponse({"models": []})
    expires = "9999-12-31T23:59:59Z" if service.expires == math.inf else rfc3339(
        datetime.fromtimestamp(service.expires, UTC))
    return JSONResponse({"models": [{
        **service.card.summary(), "expires_at": expires, "size_vram": 0,
        "context_length": service.context_length,
        "cfr_atlas": {"active": s.active, "queued": s.queued,
                      "resident_kv_bytes": s.resident_kv_bytes}}]})


async def version(request: Request) -> Response:
    from cfr_atlas import __version__

    return JSONResponse({"version": API_VERSION, "cfr_atlas": __version__})


ROUTES = [
    Route("/api/version", version, methods=["GET"]),
    Route("/api/tags", tags, methods=["GET"]),
    Route("/api/ps", ps, methods=["GET"]),
    Route("/api/show", show, methods=["POST"]),
    Route("/api/generate", generate, methods=["POST"]),
    Route("/api/chat", chat, methods=["POST"]),
    Route("/api/embed", embed, methods=["POST"]),
    Route("/api/embeddings", embeddings, methods=["POST"]),
]
