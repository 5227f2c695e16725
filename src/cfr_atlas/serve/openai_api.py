"""OpenAI's API: /v1/models, /v1/chat/completions, /v1/completions, /v1/embeddings.

Streaming is server-sent events ending with `data: [DONE]`; `usage` counts prompt and
completion tokens (the end-of-generation token included) with `prompt_tokens_details.
cached_tokens` from the prefix cache; `stream_options.include_usage` adds the usage
chunk. Non-streaming responses also carry our K/V telemetry under `cfr_atlas`. Sampling
defaults are the engine's (greedy), not OpenAI's temperature 1. `response_format` constrains
generation (text/grammar.py); `logprobs` come from the raw logits (logprobs.py), with `echo`
scoring the prompt on /v1/completions; `tools` are rendered by the model's template and
`<tool_call>` blocks parsed into `tool_calls` (text/tools.py). Validation lives in `params`.
"""

from __future__ import annotations

import base64
import json
import time
import uuid

import numpy as np
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cfr_atlas.errors import ConfigError
from cfr_atlas.serve.http import (
    endpoint,
    openai_error,
    openai_error_body,
    read_json,
    sse,
    stream,
    until_done,
)
from cfr_atlas.serve.params import (
    chat_messages,
    embed_inputs,
    get_bool,
    get_cache_salt,
    get_dimensions,
    get_object,
    get_str,
    get_tools,
    kv_budget,
    openai_options,
    refuse,
    tool_choice,
)
from cfr_atlas.serve.service import Handle, Service, shrink
from cfr_atlas.text.tools import ToolText, parse_tool_calls


def _service(request: Request) -> Service:
    return request.app.state.service


async def _request(request: Request) -> tuple[Service, dict, str]:
    service = _service(request)
    body = await read_json(request, service.config.max_body_bytes)
    name = service.card.resolve(get_str(body, "model"))
    service.keep(None)  # OpenAI has no keep_alive: each request keeps the server's default
    return service, body, name


def _usage(outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.eval_count,
            "total_tokens": outcome.prompt_tokens + outcome.eval_count,
            "prompt_tokens_details": {
                "cached_tokens": outcome.telemetry.get("prompt_cached_tokens", 0)}}


class _Scores:
    """Log-probabilities in OpenAI's shapes: chat {"content": [{"token", "logprob", "bytes",
    "top_logprobs"}]}; completions {"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}. `first` is the echoed prompt's first token (no logprob: nothing before
    it); `offset` counts the characters of text already sent, for `text_offset`."""

    def __init__(self, service: Service, chat: bool, first: int | None = None):
        self.service, self.chat, self.first = service, chat, first
        self.offset = 0

    def _entry(self, token: int, logprob: float) -> dict:
        return {"token": self.service.token_text(token), "logprob": logprob,
                "bytes": list(self.service.token_bytes(token))}

    def render(self, scored: list) -> dict:
        if self.chat:
            return {"content": [{**self._entry(s.token, s.logprob),
                                 "top_logprobs": [self._entry(t, lp) for t, lp in s.top]}
                                for s in scored], "refusal": None}
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        if self.first is not None:  # the echoed prompt's first token
            scored = [None, *scored]
        for s in scored:
            token = self.first if s is None else s.token
            text = self.service.token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if s is None else s.logprob)
            out["top_logprobs"].append(None if s is None else {
                self.service.token_text(t): lp for t, lp in s.top})
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        self.first = None
        return out


def _choice(chat: bool, text: str | None, finish: str | None, *, delta: bool,
            logprobs: dict | None = None) -> dict:
    if not chat:
        return {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    key = "delta" if delta else "message"
    body = {} if text is None else ({"content": text} if delta else
                                    {"role": "assistant", "content": text})
    return {"index": 0, key: body, "logprobs": logprobs, "finish_reason": finish}


def _tool_calls(calls, delta: bool) -> list[dict]:
    """OpenAI's tool calls: arguments as a JSON string; `index` in stream deltas."""
    return [{**({"index": i} if delta else {}), "id": "call_" + uuid.uuid4().hex[:24],
             "type": "function",
             "function": {"name": c.name, "arguments": json.dumps(c.arguments,
                                                                  ensure_ascii=False)}}
            for i, c in enumerate(calls)]


def _tool_message(text: str, names: list[str]) -> tuple[dict, bool]:
    """A chat message with its `<tool_call>` blocks parsed; True if it holds calls."""
    rest, calls = parse_tool_calls(text, names)
    message = {"role": "assistant", "content": rest or None}
    if calls:
        message["tool_calls"] = _tool_calls(calls, delta=False)
    return message, bool(calls)


async def _respond(request: Request, handle: Handle, name: str, *, chat: bool,
                   streaming: bool, include_usage: bool, prefix: str = "",
                   scores: _Scores | None = None,
                   tools: list[str] | None = None) -> Response:
    """A chat.completion / text_completion object, or their SSE chunks then [DONE].
    With `scores`, choices carry log-probabilities (see `_Scores`); with `tools` (names), the
    `<tool_call>` blocks become `tool_calls` (streamed as one delta after the content) and
    finish_reason "tool_calls"."""
    from cfr_atlas import __version__

    head = {"id": ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": name,
            "system_fingerprint": f"cfr-atlas-{__version__}"}
    if not streaming:
        text, outcome = await until_done(request, handle, handle.result())
        lp = None if scores is None else scores.render(
            [*outcome.prompt_logprobs, *outcome.logprobs])
        choice = _choice(chat, prefix + text, outcome.done_reason, delta=False, logprobs=lp)
        if tools:
            choice["message"], called = _tool_message(text, tools)
            choice["finish_reason"] = "tool_calls" if called else outcome.done_reason
        return JSONResponse({**head, "choices": [choice], "usage": _usage(outcome),
                             "cfr_atlas": outcome.telemetry})
    if chat:
        head["object"] = "chat.completion.chunk"
    opened = [False]
    pending: list = []
    calls = ToolText(tools) if tools else None

    def taken() -> dict | None:
        if scores is None or not pending:
            return None
        out = scores.render(list(pending))
        pending.clear()
        return out

    def opening() -> bytes:
        """The role delta of a chat stream; the echoed prompt of a completion stream."""
        if chat:
            choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                      "logprobs": None, "finish_reason": None}
            return sse({**head, "choices": [choice]})
        if not prefix:
            return b""
        return sse({**head, "choices": [_choice(False, prefix, None, delta=True,
                                                logprobs=taken())]})

    def render(kind: str, value) -> bytes:
        if kind in ("logprobs", "prompt_logprobs"):
            pending.extend(value)
            return b""
        out = b"" if opened[0] else opening()
        opened[0] = True
        if kind == "text":
            text = value if calls is None else calls.push(value)
            if not text:
                return out
            return out + sse({**head, "choices": [_choice(chat, text, None, delta=True,
                                                          logprobs=taken())]})
        finish = value.done_reason
        if calls is not None:
            rest, found = calls.finish()
            if rest:
                out += sse({**head, "choices": [_choice(True, rest, None, delta=True)]})
            if found:
                delta = {"index": 0, "delta": {"tool_calls": _tool_calls(found, delta=True)},
                         "logprobs": None, "finish_reason": None}
                out += sse({**head, "choices": [delta]})
                finish = "tool_calls"
        out += sse({**head, "choices": [_choice(chat, None if chat else "", finish,
                                                delta=True, logprobs=taken())]})
        if include_usage:
            out += sse({**head, "choices": [], "usage": _usage(value)})
        return out + sse("[DONE]")

    return await stream(request, handle, render, lambda e: sse(openai_error_body(e)),
                        "text/event-stream")


@endpoint(openai_error)
async def chat_completions(request: Request) -> Response:
    service, body, name = await _request(request)
    messages = chat_messages(body)
    opts = openai_options(body, service.context_length)
    streaming = get_bool(body, "stream", False)
    include_usage = get_bool(get_object(body, "stream_options"), "include_usage", False,
                             where="stream_options.")
    tools = get_tools(body)
    use, forced = tool_choice(body, tools)
    tools = tools if use else None
    ids = service.chat_ids(messages, tools)
    constraint = None if forced is None else service.forced_call(tools, forced)
    handle = service.start_generation(ids, opts, constraint=constraint)
    scores = None if opts.logprobs is None else _Scores(service, chat=True)
    return await _respond(request, handle, name, chat=True, streaming=streaming,
                          include_usage=include_usage, scores=scores,
                          tools=None if tools is None else [t["function"]["name"] for t in tools])


@endpoint(openai_error)
async def completions(request: Request) -> Response:
    """Raw completion of one prompt (a string or token ids); no chat template."""
    service, body, name = await _request(request)
    prompts = embed_inputs(body, "prompt", token_ids=True)
    if len(prompts) != 1:
        raise ConfigError("prompt", f"only one prompt per request is supported, got "
                                    f"{len(prompts)}")
    refuse(body, "suffix", "no fill-in-the-middle")
    if body.get("best_of") not in (None, 1):
        raise ConfigError("best_of", f"only best_of=1 is supported, got {body['best_of']!r:.40}")
    opts = openai_options(body, service.context_length, chat=False)
    streaming = get_bool(body, "stream", False)
    include_usage = get_bool(get_object(body, "stream_options"), "include_usage", False,
                             where="stream_options.")
    prompt = prompts[0]
    # a completion prompt is the client's whole template: control-token text is parsed
    ids = service.tokenize(prompt, special=True) if isinstance(prompt, str) else prompt
    if opts.truncate:  # here, so that an echo shows (and scores) the prompt actually run
        kept = service.truncated(ids, opts.num_ctx or service.context_length)
        prompt, ids = (prompt if kept is ids else service.model.detokenize(kept)), kept
    echo = get_bool(body, "echo", False)
    prefix = "" if not echo else (prompt if isinstance(prompt, str)
                                  else service.model.detokenize(prompt))
    scoring = echo and opts.logprobs is not None  # prompt scoring: every prompt token too
    handle = service.start_generation(ids, opts, prompt_logprobs=scoring)
    scores = None if opts.logprobs is None else _Scores(
        service, chat=False, first=ids[0] if scoring else None)
    return await _respond(request, handle, name, chat=False, streaming=streaming,
                          include_usage=include_usage, prefix=prefix, scores=scores)


@endpoint(openai_error)
async def embeddings(request: Request) -> Response:
    service, body, name = await _request(request)
    inputs = embed_inputs(body, "input", token_ids=True)
    fmt = get_str(body, "encoding_format", "float")
    if fmt not in ("float", "base64"):
        raise ConfigError("encoding_format", f"must be 'float' or 'base64', got {fmt!r}")
    dims = get_dimensions(body, service.model.config.dim)
    handle = service.start_embedding(inputs, kv_budget(body), get_cache_salt(body))
    _, outcome = await until_done(request, handle, handle.result())
    data = []
    for i, v in enumerate(outcome.vectors):
        values = shrink(v, dims)
        if fmt == "base64":
            values = base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()
        data.append({"object": "embedding", "index": i, "embedding": values})
    n = outcome.prompt_tokens
    return JSONResponse({"object": "list", "data": data, "model": name,
                         "usage": {"prompt_tokens": n, "total_tokens": n}})


def _model_entry(service: Service) -> dict:
    return {"id": service.card.name, "object": "model", "created": int(service.started),
            "owned_by": "cfr-atlas"}


@endpoint(openai_error)
async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model_entry(_service(request))]})


@endpoint(openai_error)
async def model(request: Request) -> Response:
    service = _service(request)
    service.card.resolve(request.path_params["name"])
    return JSONResponse(_model_entry(service))


ROUTES = [
    Route("/v1/models", models, methods=["GET"]),
    Route("/v1/models/{name:path}", model, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
]
