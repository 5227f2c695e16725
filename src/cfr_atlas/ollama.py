"""A typed client for any Ollama-compatible server: `cfr-atlas serve`, or Ollama itself.

`OllamaClient(host)` lists, shows (with the model's topology parsed from `model_info`),
generates, chats (each streaming or not) and embeds, over httpx. Hosts are normalised the way
Ollama's own tools read OLLAMA_HOST ("localhost" -> "http://localhost:11434"). A non-2xx
answer raises a typed `ApiError` subclass carrying the status and the server's message;
an unreachable server raises `ApiConnectionError`.

Exact K/V is not reachable this way: the Ollama API returns text, token counts and pooled
embeddings, never a layer's keys and values, so `exact_kv` raises `ExactKvUnavailableError`
and says what to do instead. This module imports nothing of the engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from cfr_atlas.errors import (
    ApiBadRequestError,
    ApiBusyError,
    ApiConnectionError,
    ApiError,
    ApiNotFoundError,
    ApiServerError,
    ConfigError,
    ExactKvUnavailableError,
)

DEFAULT_PORT = 11434
_EXACT_KV = (
    "exact K/V is not available through an Ollama-compatible HTTP API: it returns text, token "
    "counts and pooled embeddings, never a layer's keys and values (and a public server would "
    "leak other users' context if it did). Load the model in-process instead: "
    "cfr_atlas.engine.load_model(path).session(...) gives the exact K/V of a sequence."
)


def normalize_host(host: str | None = None) -> str:
    """'localhost' -> 'http://localhost:11434', ':8080' -> 'http://127.0.0.1:8080',
    'https://example.com/api/' -> 'https://example.com:443'; None reads OLLAMA_HOST."""
    raw = (host or os.environ.get("OLLAMA_HOST") or "127.0.0.1").strip()
    parts = urlsplit(raw if "://" in raw else "http://" + raw)
    if parts.scheme not in ("http", "https"):
        raise ConfigError("host", f"scheme must be http or https, got {raw!r}")
    try:
        port = parts.port or (443 if parts.scheme == "https" and "://" in raw else DEFAULT_PORT)
    except ValueError:
        raise ConfigError("host", f"bad port in {raw!r}") from None
    name = parts.hostname or "127.0.0.1"
    name = "127.0.0.1" if name == "0.0.0.0" else name
    name = f"[{name}]" if ":" in name else name
    path = parts.path.rstrip("/").removesuffix("/api")
    return f"{parts.scheme}://{name}:{port}{path}"


@dataclass(frozen=True)
class Topology:
    """Model shape read from `model_info` ({arch}.block_count, ...)."""

    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int | None
    context_length: int | None

    @classmethod
    def from_model_info(cls, info: Mapping) -> Topology | None:
        """None when the server reports no architecture or no layer/width/head counts."""
        arch = info.get("general.architecture")
        if not isinstance(arch, str):
            return None
        key = {k.removeprefix(arch + "."): v for k, v in info.items()}
        need = ("block_count", "embedding_length", "attention.head_count")
        if not all(isinstance(key.get(k), int) for k in need):
            return None
        n_heads = key["attention.head_count"]
        return cls(arch=arch, n_layers=key["block_count"], dim=key["embedding_length"],
                   n_heads=n_heads, n_kv_heads=key.get("attention.head_count_kv") or n_heads,
                   head_dim=key.get("attention.key_length")
                   or key["embedding_length"] // n_heads,
                   hidden_dim=key.get("feed_forward_length"),
                   context_length=key.get("context_length"))

    def kv_bytes_per_token(self, itemsize: int = 2) -> int:
        """K + V bytes one token adds across all layers (2 = float16)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class ModelSummary:
    name: str
    size: int
    digest: str
    modified_at: str
    details: dict


@dataclass(frozen=True)
class ModelShow:
    name: str
    details: dict
    model_info: dict
    template: str
    capabilities: list[str]
    topology: Topology | None


@dataclass(frozen=True)
class Stats:
    """The final object's counters; durations in nanoseconds. `extra`: the `cfr_atlas` key."""

    done_reason: str | None
    total_duration: int = 0
    load_duration: int = 0
    prompt_eval_count: int = 0
    prompt_eval_cached_count: int = 0
    prompt_eval_duration: int = 0
    eval_count: int = 0
    eval_duration: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_json(cls, obj: Mapping) -> Stats:
        ints = ("total_duration", "load_duration", "prompt_eval_count", "prompt_eval_cached_count",
                "prompt_eval_duration", "eval_count", "eval_duration")
        return cls(done_reason=obj.get("done_reason"), extra=obj.get("cfr_atlas") or {},
                   **{k: int(obj.get(k) or 0) for k in ints})

    @property
    def tokens_per_second(self) -> float:
        return self.eval_count / (self.eval_duration / 1e9) if self.eval_duration else 0.0


@dataclass(frozen=True)
class Chunk:
    """One streamed piece; the last one has done=True and the stats."""

    text: str
    done: bool
    stats: Stats | None = None


@dataclass(frozen=True)
class Completion:
    text: str
    stats: Stats


@dataclass(frozen=True)
class Embeddings:
    vectors: list[list[float]]
    prompt_eval_count: int
    total_duration: int


_STATUS_ERRORS = {400: ApiBadRequestError, 422: ApiBadRequestError, 404: ApiNotFoundError,
                  429: ApiBusyError, 503: ApiBusyError}


def _message(response: httpx.Response) -> str:
    try:
        err = response.json().get("error", response.text)
    except (ValueError, AttributeError):
        return response.text.strip() or response.reason_phrase
    return err.get("message", str(err)) if isinstance(err, dict) else str(err)


def _raise_for(response: httpx.Response) -> None:
    if response.is_success:
        return
    response.read()
    status, url, msg = response.status_code, str(response.url), _message(response)
    cls = _STATUS_ERRORS.get(status, ApiServerError if status >= 500 else ApiError)
    if cls is ApiBusyError:
        after = response.headers.get("Retry-After")
        raise ApiBusyError(status, msg, url, float(after) if after and after.isdigit() else None)
    raise cls(status, msg, url)


class OllamaClient:
    """Synchronous client; use as a context manager or call `close()`."""

    def __init__(self, host: str | None = None, *, timeout: float = 300.0,
                 transport: httpx.BaseTransport | None = None):
        self.base_url = normalize_host(host)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, transport=transport)

    def __enter__(self) -> OllamaClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    # --- transport ---------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: dict | None = None) -> dict:
        try:
            response = self._http.request(method, path, json=body)
        except httpx.TransportError as e:
            raise ApiConnectionError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None
        _raise_for(response)
        return response.json()

    def _lines(self, path: str, body: dict) -> Iterator[dict]:
        try:
            with self._http.stream("POST", path, json=body) as response:
                _raise_for(response)
                for line in response.iter_lines():
                    if not line.strip():
                        continue
                    obj = json.loads(line)
                    if "error" in obj:
                        raise ApiError(response.status_code, str(obj["error"]),
                                       str(response.url))
                    yield obj
        except httpx.TransportError as e:
            raise ApiConnectionError(f"{self.base_url}{path}: {type(e).__name__}: {e}") from None

    # --- models ------------------------------------------------------------------------------
    def version(self) -> str:
        return self._call("GET", "/api/version")["version"]

    def list(self) -> list[ModelSummary]:
        return [ModelSummary(name=m.get("name") or m.get("model", ""), size=m.get("size", 0),
                             digest=m.get("digest", ""), modified_at=m.get("modified_at", ""),
                             details=m.get("details") or {})
                for m in self._call("GET", "/api/tags").get("models", [])]

    def show(self, model: str) -> ModelShow:
        r = self._call("POST", "/api/show", {"model": model})
        info = r.get("model_info") or {}
        return ModelShow(name=model, details=r.get("details") or {}, model_info=info,
                         template=r.get("template", ""), capabilities=r.get("capabilities", []),
                         topology=Topology.from_model_info(info))

    # --- generation ----------------------------------------------------------------------------
    @staticmethod
    def _generate_body(model, prompt, system, raw, options, stream) -> dict:
        body = {"model": model, "prompt": prompt, "raw": raw, "stream": stream,
                "options": dict(options or {})}
        if system is not None:
            body["system"] = system
        return body

    def generate(self, model: str, prompt: str, *, system: str | None = None,
                 raw: bool = False, options: Mapping | None = None) -> Completion:
        r = self._call("POST", "/api/generate",
                       self._generate_body(model, prompt, system, raw, options, False))
        return Completion(r.get("response", ""), Stats.from_json(r))

    def generate_stream(self, model: str, prompt: str, *, system: str | None = None,
                        raw: bool = False, options: Mapping | None = None) -> Iterator[Chunk]:
        body = self._generate_body(model, prompt, system, raw, options, True)
        for obj in self._lines("/api/generate", body):
            done = bool(obj.get("done"))
            yield Chunk(obj.get("response", ""), done, Stats.from_json(obj) if done else None)

    def chat(self, model: str, messages: list[Mapping], *,
             options: Mapping | None = None) -> Completion:
        r = self._call("POST", "/api/chat", {"model": model, "messages": list(messages),
                                             "stream": False, "options": dict(options or {})})
        return Completion((r.get("message") or {}).get("content", ""), Stats.from_json(r))

    def chat_stream(self, model: str, messages: list[Mapping], *,
                    options: Mapping | None = None) -> Iterator[Chunk]:
        body = {"model": model, "messages": list(messages), "stream": True,
                "options": dict(options or {})}
        for obj in self._lines("/api/chat", body):
            done = bool(obj.get("done"))
            text = (obj.get("message") or {}).get("content", "")
            yield Chunk(text, done, Stats.from_json(obj) if done else None)

    def embed(self, model: str, inputs: str | list[str], *,
              dimensions: int | None = None) -> Embeddings:
        body = {"model": model, "input": inputs}
        if dimensions is not None:
            body["dimensions"] = dimensions
        r = self._call("POST", "/api/embed", body)
        return Embeddings(r.get("embeddings", []), int(r.get("prompt_eval_count") or 0),
                          int(r.get("total_duration") or 0))

    def exact_kv(self, model: str, *args, **kwargs):
        """Always raises ExactKvUnavailableError: see the module docstring."""
        raise ExactKvUnavailableError(f"{model}: {_EXACT_KV}")
