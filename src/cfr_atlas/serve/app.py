"""The ASGI application and the uvicorn runner behind `cfr-atlas serve`.

`create_app(model, config)` wires the Ollama and OpenAI routes, `/`, `/metrics` and llama.cpp's
`/tokenize` / `/detokenize` around one
`Service`; the scheduler's worker thread starts and stops with the app's lifespan. `serve`
loads the model and runs uvicorn (loopback unless told otherwise). Routing-level errors
(unknown path, wrong method) get the same JSON error shapes as the handlers.
"""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from cfr_atlas.errors import ConfigError
from cfr_atlas.generate import check_ids
from cfr_atlas.kernel_threads import release_pool
from cfr_atlas.serve import metrics, ollama_api, openai_api
from cfr_atlas.serve.http import endpoint, internal, ollama_error, openai_error, read_json
from cfr_atlas.serve.params import get_bool, get_str
from cfr_atlas.serve.service import ServerConfig, Service

log = logging.getLogger("cfr_atlas.serve")


async def _root(request: Request) -> Response:
    return PlainTextResponse("cfr-atlas is running (Ollama and OpenAI compatible API)")


async def _metrics(request: Request) -> Response:
    state = request.app.state
    text = metrics.render(state.counts.snapshot(), state.service.scheduler.stats())
    text += metrics.render_store(state.service.model.prefix_store_stats())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@endpoint(ollama_error)
async def _tokenize(request: Request) -> Response:
    """llama.cpp's server: {"content": str, "add_special": bool, "parse_special": bool} ->
    {"tokens": [ids]}. add_special adds BOS/EOS as the GGUF says (default false);
    parse_special maps control-token text to its id (default true, as llama.cpp)."""
    service = request.app.state.service
    body = await read_json(request, service.config.max_body_bytes)
    text = get_str(body, "content")
    special = get_bool(body, "parse_special", True)
    add = get_bool(body, "add_special", False)
    per_gguf = None if add else False
    ids = service.model.tokenizer.encode(text, add_bos=per_gguf, add_eos=per_gguf,
                                         special=special)
    return JSONResponse({"tokens": ids})


@endpoint(ollama_error)
async def _detokenize(request: Request) -> Response:
    """{"tokens": [ids]} -> {"content": str}; an id outside the vocabulary is a 400."""
    service = request.app.state.service
    body = await read_json(request, service.config.max_body_bytes)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            for i in ids):
        raise ConfigError("tokens", "must be a list of token ids (integers)")
    if ids:
        check_ids(ids, service.model.config.vocab_size)
    return JSONResponse({"content": service.model.detokenize(ids)})


async def _http_error(request: Request, exc: HTTPException) -> Response:
    message = f"{request.method} {request.url.path}: {exc.detail}"
    if request.url.path.startswith("/v1/"):
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": None}}
    else:
        body = {"error": message}
    return JSONResponse(body, exc.status_code, headers=exc.headers)


async def _server_error(request: Request, exc: Exception) -> Response:
    """Outside any handler (middleware, routing): the same generic 500 with a request id."""
    exc = internal(exc, f"{request.method} {request.url.path}")
    return (openai_error if request.url.path.startswith("/v1/") else ollama_error)(exc)


def create_app(model, config: ServerConfig | None = None) -> Starlette:
    """The ASGI app serving `model` (a loaded `cfr_atlas.engine.Model`)."""
    config = config or ServerConfig()
    service = Service(model, config)
    routes = [Route("/", _root, methods=["GET"]), Route("/metrics", _metrics, methods=["GET"]),
              Route("/tokenize", _tokenize, methods=["POST"]),
              Route("/detokenize", _detokenize, methods=["POST"]),
              *ollama_api.ROUTES, *openai_api.ROUTES]
    counts = metrics.RequestCounts({r.path for r in routes})

    @asynccontextmanager
    async def lifespan(app):
        service.scheduler.start()
        try:
            yield
        finally:
            service.scheduler.stop()

    app = Starlette(routes=routes, lifespan=lifespan,
                    middleware=[Middleware(metrics.RequestCounter, counts=counts)],
                    exception_handlers={HTTPException: _http_error,
                                        Exception: _server_error})
    app.state.service = service
    app.state.counts = counts
    return app


def warm_up(model) -> None:
    """Compile (or load from numba's cache) what serving runs before a client waits for it:
    one stream's prefill and decode (its walks through HotWalks' single-member call), and
    decode steps of two sequences at once, with their
    walks side by side and in turn (the batched walks' two drivers and their typed lists,
    atlas/batch_walk.py: ~1 s of compiling in every process)."""
    from cfr_atlas.models.batch import BatchItem

    model.generate("hi", max_tokens=2)
    short = np.asarray(model.tokenize("hi"), dtype=np.int64)
    long = np.resize(short, 40)  # over 16-token pages: one walk more than half of a pair's
    sessions = [model.session(), model.session(), model.session(page_tokens=16)]
    try:
        for s, ids in zip(sessions, (short, short, long), strict=True):
            model.net.forward_chunk(s, ids, output=False)
        for pair in (sessions[:2], sessions[:2], sessions[1:]):  # side by side twice, in turn
            out = model.net.forward_batch([BatchItem(s, short[-1:]) for s in pair])
            for r in out:
                if isinstance(r, Exception):
                    raise r
    finally:
        for s in sessions:
            s.close()


def serve(config: ServerConfig, **load_kw) -> None:
    """Load the model (`load_model(config.model_path, **load_kw)`: prefix_cache,
    prefix_cache_bytes, prefix_store, prefix_store_ttl) and serve it with uvicorn until
    interrupted."""
    import uvicorn

    from cfr_atlas.engine import load_model

    model = load_model(config.model_path, **load_kw)
    warm_up(model)
    app = create_app(model, config)
    _ = app.state.service.grammar  # prepare the structured-output vocabulary (0.2-4 s) now
    # From here the scheduler thread runs every kernel: free the pool the main thread built,
    # which would otherwise make the scheduler's kernels sleep at every barrier (a stream's
    # token took 1.7-2.4x as long: docs/PERFORMANCE.md, "Session 37")
    if not release_pool():
        log.info("no OpenMP pool to release on the main thread (kernel_threads.release_pool)")
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"cfr-atlas: warning: listening on {config.host}: the API has no "
              "authentication", file=sys.stderr)
    print(f"cfr-atlas: serving {app.state.service.card.name} on "
          f"http://{config.host}:{config.port}", file=sys.stderr)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=5)
