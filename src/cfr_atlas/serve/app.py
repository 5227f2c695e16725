"""The ASGI application and the uvicorn runner behind `cfr-atlas serve`.

`create_app(model, config)` wires the Ollama and OpenAI routes, `/` and `/metrics` around one
`Service`; the scheduler's worker thread starts and stops with the app's lifespan. `serve`
loads the model and runs uvicorn (loopback unless told otherwise). Routing-level errors
(unknown path, wrong method) get the same JSON error shapes as the handlers.
"""

from __future__ import annotations

import logging
import sys
from contextlib import asynccontextmanager

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from cfr_atlas.serve import metrics, ollama_api, openai_api
from cfr_atlas.serve.http import internal, ollama_error, openai_error
from cfr_atlas.serve.service import ServerConfig, Service

log = logging.getLogger("cfr_atlas.serve")


async def _root(request: Request) -> Response:
    return PlainTextResponse("cfr-atlas is running (Ollama and OpenAI compatible API)")


async def _metrics(request: Request) -> Response:
    state = request.app.state
    text = metrics.render(state.counts.snapshot(), state.service.scheduler.stats())
    text += metrics.render_store(state.service.model.prefix_store_stats())
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


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


def serve(config: ServerConfig, **load_kw) -> None:
    """Load the model (`load_model(config.model_path, **load_kw)`: prefix_cache,
    prefix_cache_bytes, prefix_store, prefix_store_ttl) and serve it with uvicorn until
    interrupted."""
    import uvicorn

    from cfr_atlas.engine import load_model

    model = load_model(config.model_path, **load_kw)
    model.generate("hi", max_tokens=2)  # compile the kernels before a client waits for them
    app = create_app(model, config)
    if config.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"cfr-atlas: warning: listening on {config.host}: the API has no "
              "authentication", file=sys.stderr)
    print(f"cfr-atlas: serving {app.state.service.card.name} on "
          f"http://{config.host}:{config.port}", file=sys.stderr)
    uvicorn.run(app, host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=5)
