"""HTTP plumbing shared by both APIs: JSON bodies, error responses, disconnects, streaming.

  * `read_json` reads at most `limit` bytes and insists on a JSON object nested at most
    MAX_DEPTH levels (deeper, or too deep for Python's parser, is a 400).
  * `error_status` maps our typed errors to HTTP: unknown model 404, full queue 429 (with
    Retry-After), anything else the client caused 400, a failed K/V page 500 — always with
    the error's own message. Any other exception is a bug: the client gets a 500 saying only
    "internal error" and a request id; the traceback goes to the server log under that id.
    `ollama_error` / `openai_error` give each API's error shape.
  * `until_done` awaits a job while watching the connection: a client that goes away gets
    its job cancelled (the scheduler then releases its session) instead of running on.
It holds no route and no response shape beyond errors.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from cfr_atlas.errors import (
    AtlasError,
    ConfigError,
    ModelNotFoundError,
    PageError,
    QueueFullError,
    RegeneratorError,
)

log = logging.getLogger("cfr_atlas.serve")
MAX_DEPTH = 64  # nesting of arrays / objects in a request body


class InternalError(Exception):
    """What the client learns of a bug: a request id to quote, nothing of the internals."""

    def __init__(self, request_id: str):
        super().__init__(f"internal server error (request id {request_id}); the details are in "
                         "the server log")
        self.request_id = request_id


def internal(exc: Exception, what: str) -> Exception:
    """Typed errors pass through; anything else is logged with a fresh id -> InternalError."""
    if isinstance(exc, AtlasError | InternalError):
        return exc
    request_id = uuid.uuid4().hex[:16]
    log.error("request %s: %s failed", request_id, what, exc_info=exc)
    return InternalError(request_id)


class ClientGone(Exception):
    """The client closed the connection while its request was running."""


async def read_json(request: Request, limit: int) -> dict:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise ConfigError("body", f"is larger than the {limit}-byte limit")
    if not body.strip():
        raise ConfigError("body", "is empty; send a JSON object")
    try:
        value = json.loads(body)
    except RecursionError:
        raise ConfigError("body", f"nests arrays / objects deeper than {MAX_DEPTH} levels") \
            from None
    except ValueError as e:  # JSONDecodeError, bad UTF-8, an integer of over 4300 digits
        raise ConfigError("body", f"is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(value, dict):
        raise ConfigError("body", f"must be a JSON object, got {type(value).__name__}")
    _check_depth(value)
    return value


def _check_depth(value) -> None:
    """Refuse bodies nested deeper than MAX_DEPTH (level by level: no recursion to exhaust)."""
    level, depth = [value], 1
    while level:
        if depth > MAX_DEPTH:
            raise ConfigError("body", f"nests arrays / objects deeper than {MAX_DEPTH} levels")
        level = [v for c in level for v in (c.values() if isinstance(c, dict) else c)
                 if isinstance(v, dict | list)]
        depth += 1


def error_status(exc: Exception) -> int:
    if isinstance(exc, ModelNotFoundError):
        return 404
    if isinstance(exc, QueueFullError):
        return 429
    if isinstance(exc, PageError | RegeneratorError) or not isinstance(exc, AtlasError):
        return 500
    return 400


def _headers(exc: Exception) -> dict:
    if isinstance(exc, InternalError):
        return {"X-Request-Id": exc.request_id}
    return {"Retry-After": str(exc.retry_after)} if isinstance(exc, QueueFullError) else {}


def ollama_error(exc: Exception) -> Response:
    """Ollama's shape: {"error": "message"}."""
    return JSONResponse({"error": str(exc)}, error_status(exc), headers=_headers(exc))


_OPENAI_TYPES = {400: "invalid_request_error", 404: "not_found_error",
                 429: "rate_limit_error", 500: "server_error"}


def openai_error_body(exc: Exception) -> dict:
    status = error_status(exc)
    code = "model_not_found" if status == 404 else ("context_length_exceeded"
                                                   if "context limit" in str(exc) else None)
    return {"error": {"message": str(exc), "type": _OPENAI_TYPES[status],
                      "param": getattr(exc, "field", None), "code": code}}


def openai_error(exc: Exception) -> Response:
    """OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
    return JSONResponse(openai_error_body(exc), error_status(exc), headers=_headers(exc))


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_done(request: Request, handle, awaitable):
    """Await `awaitable` unless the client disconnects first: then cancel the job, ClientGone."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        handle.cancel()
        raise
    finally:
        watch.cancel()
    if task in done:
        return task.result()
    task.cancel()
    handle.cancel()
    raise ClientGone()


def ndjson(obj: dict) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


def endpoint(render_error):
    """Decorate a handler: typed errors -> `render_error(exc)`; a bug -> logged, a 500."""
    def wrap(handler):
        @functools.wraps(handler)
        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except (ClientGone, ClientDisconnect):
                return Response(status_code=499)  # nobody reads it; nginx's "client closed"
            except Exception as exc:  # typed: its own message; a bug: an id, logged
                return render_error(internal(exc, f"{request.method} {request.url.path}"))
        return run
    return wrap


async def stream(request: Request, handle, render, render_error, media_type: str) -> Response:
    """A streaming response of `render(kind, value) -> bytes` per event.

    The first event is awaited before the headers go out, so an error at the start (a K/V
    budget too small, a failing prefill) is still a plain 4xx. Later errors are rendered
    in-stream by `render_error`. If the client goes away, the job is cancelled.
    """
    first = await until_done(request, handle, handle.next_event())

    async def body():
        try:
            event = first
            while True:
                yield render(*event)
                if event[0] == "done":
                    return
                event = await handle.next_event()
        except Exception as exc:  # typed or not, the client gets a last line saying so
            yield render_error(internal(exc, f"{request.method} {request.url.path} "
                                             "mid-stream"))
        finally:
            handle.cancel()  # a no-op once the job has ended

    return StreamingResponse(body(), media_type=media_type)
