"""`Service`: the one model, its card and its scheduler, as the HTTP handlers see them.

Handlers turn requests into prompt ids and `GenOptions`; the service checks the context limit
(a prompt that does not fit is a `CapacityError` with the numbers — never truncated) and the
K/V budget against the operator's ceiling (`--kv-budget`: a request may ask for less, never
more; percentages on either side are compared as the bytes they resolve to), builds the job
with its Session kwargs (budget, page folder, `cache_salt`), submits it and hands back a
`Handle` the handler awaits. `ServerConfig` holds the settings `cfr-atlas serve` exposes.
HTTP, JSON and response shapes live in the api modules.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import numpy as np

from cfr_atlas.errors import CapacityError, ConfigError
from cfr_atlas.generate import check_ids
from cfr_atlas.models.session import full_kv_bytes, resolve_kv_budget
from cfr_atlas.serve.card import ModelCard
from cfr_atlas.serve.jobs import Channel, EmbeddingJob, GenerationJob, GenerationSpec, Job
from cfr_atlas.serve.params import GenOptions
from cfr_atlas.serve.scheduler import Scheduler
from cfr_atlas.text.grammar import TokenGrammar
from cfr_atlas.text.tools import forced_call_grammar, supports_tools


@dataclass(frozen=True)
class ServerConfig:
    """Settings of one server; see docs/SERVING.md for what each one does."""

    host: str = "127.0.0.1"
    port: int = 11434
    model_path: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    model_name: str | None = None  # None: the file name, lower case, ":latest"
    kv_budget: int | str | None = None  # per-request budget and ceiling: bytes, or "10%" of
    # the full K/V at the model's context length; None: unbounded
    cache_dir: str | None = None  # page files of budgeted sessions; None: the user cache
    max_active: int = 8  # sequences decoded together (one batched forward pass per step)
    max_queue: int = 16  # requests waiting beyond those; more -> 429
    prefill_tokens: int = 256  # prompt / embedding tokens per batched step, across sequences
    max_tokens: int | None = None  # when a request sets no limit; None: until context is full
    retry_after: int = 1  # seconds, sent with 429
    max_body_bytes: int = 16 << 20
    max_embed_tokens: int = 1 << 17  # tokens of one embedding request, all inputs together
    keep_alive: float = 300.0  # seconds the model counts as loaded after a request (Ollama's 5m)


def shrink(vector: np.ndarray, dims: int | None) -> list[float]:
    """The first `dims` components, L2-renormalized (Ollama's and OpenAI's `dimensions`)."""
    if dims is None or dims == vector.size:
        return vector.tolist()
    v = vector[:dims].astype(np.float64)
    return (v / max(float(np.linalg.norm(v)), 1e-12)).astype(np.float32).tolist()


class Handle:
    """The event-loop side of one submitted job: await its events, or cancel it."""

    def __init__(self, scheduler: Scheduler, job: Job, channel: Channel, t0: float):
        self.scheduler, self.job, self.channel, self.t0 = scheduler, job, channel, t0

    async def next_event(self) -> tuple[str, object]:
        """("text", str), ("logprobs" | "prompt_logprobs", [Scored]) or ("done", outcome);
        an ("error", exc) event is raised (an untyped
        one reaches the client only as an internal error with a request id: see http.py)."""
        kind, value = await self.channel.get()
        if kind == "error":
            raise value
        return kind, value

    async def events(self) -> AsyncIterator[tuple[str, object]]:
        while True:
            kind, value = await self.next_event()
            yield kind, value
            if kind == "done":
                return

    async def result(self) -> tuple[str, object]:
        """All text joined, and the outcome."""
        parts = []
        async for kind, value in self.events():
            if kind == "done":
                return "".join(parts), value
            if kind == "text":
                parts.append(value)
        raise RuntimeError("job ended without an outcome")

    def cancel(self) -> None:
        self.scheduler.cancel(self.job)

    def elapsed_ns(self) -> int:
        return int((time.perf_counter() - self.t0) * 1e9)


class Service:
    def __init__(self, model, config: ServerConfig):
        self.model, self.config = model, config
        self.card = ModelCard.from_model(model, config.model_name)
        # --kv-budget in bytes; a percentage is of the full K/V at the model's context length
        self.ceiling = None if config.kv_budget is None else resolve_kv_budget(
            config.kv_budget, full_kv_bytes(model.config, model.config.context_length))
        self.scheduler = Scheduler(max_active=config.max_active, max_queue=config.max_queue,
                                   retry_after=config.retry_after,
                                   prefill_tokens=config.prefill_tokens)
        self.started = time.time()
        self._grammar: TokenGrammar | None = None
        self.expires = math.inf if config.keep_alive < 0 else time.time() + config.keep_alive
        self._tools: bool | None = None

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

    def tokenize(self, text: str, *, special: bool = False) -> list[int]:
        """Text -> ids; `special=True` only for prompts the client templated itself (raw)."""
        return self.model.tokenize(text, special=special)

    def token_text(self, token: int) -> str:
        """One token's text (a piece of a multi-byte character decodes to U+FFFD)."""
        return self.model.tokenizer.decode([token])

    def token_bytes(self, token: int) -> bytes:
        return self.model.tokenizer.token_to_piece(token)

    def keep(self, seconds: float | None) -> None:
        """A request's `keep_alive` (None: the server's default): the model counts as loaded
        until then (negative: forever; 0: unloaded now). The weights stay mapped either way:
        this server holds one model and answers every request with it."""
        seconds = self.config.keep_alive if seconds is None else seconds
        self.expires = math.inf if seconds < 0 else time.time() + seconds

    @property
    def loaded(self) -> bool:
        return self.expires > time.time() or self.scheduler.stats().active > 0

    @property
    def supports_tools(self) -> bool:
        """Whether the model's chat template renders tool definitions (probed once)."""
        if self._tools is None:
            self._tools = supports_tools(self.model.chat_template)
        return self._tools

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Messages (and tools) -> ids; their text never becomes control tokens. Tools, tool
        calls or tool results for a template that cannot render them are a 400."""
        uses_tools = tools or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if uses_tools and not self.supports_tools:
            raise ConfigError("tools", "this model's chat template has no tool support (it "
                                       "does not render tool definitions); send the request "
                                       "without tools, tool calls or tool messages")
        context = {"tools": tools} if tools else {}
        return self.model.chat_template.encode(self.model.tokenizer, messages,
                                               add_generation_prompt=True, **context)

    def forced_call(self, tools: list[dict], name: str):
        """A constraint making the model call `name` ("*": any of `tools`)."""
        return self.grammar.constraint_lark(
            forced_call_grammar(tools, None if name == "*" else name), "tool_choice")

    def kv_budget(self, requested: int | str | None, context_limit: int) -> int | str | None:
        """The budget a request runs under: its own (bytes or a percentage, which its Session
        resolves against `context_limit` exactly as here) if that many bytes are at most the
        operator's ceiling; else the ceiling."""
        if requested is None:
            return self.ceiling
        asked = resolve_kv_budget(requested, full_kv_bytes(self.model.config, context_limit))
        if self.ceiling is not None and asked > self.ceiling:
            share = f" ({requested} of {context_limit} tokens' K/V)" if isinstance(
                requested, str) and requested.endswith("%") else ""
            raise ConfigError("kv_budget", f"{asked} bytes{share} is above this server's "
                                           f"ceiling of {self.ceiling} bytes (--kv-budget); ask "
                                           f"for at most {self.ceiling}")
        return requested

    def session_kw(self, kv_budget: int | str | None, cache_salt: str | None,
                   longest: int | None = None, **kw) -> dict:
        """Session kwargs of one request: the budget under the ceiling, the page folder, and
        the prefix-cache salt (blocks of different salts are never shared). `longest`: the
        largest context limit among the request's sessions, what a percentage is of (None:
        the model's context length)."""
        budget = self.kv_budget(kv_budget, longest or self.context_length)
        if budget is not None:
            kw.update(kv_budget=budget, cache_dir=self.config.cache_dir)
        if cache_salt is not None:
            kw["cache_salt"] = cache_salt
        return kw

    def check_fits(self, n_tokens: int, limit: int, what: str = "the prompt") -> None:
        if n_tokens > limit:
            hint = (f"; shorten it, or send \"truncate\": true to keep its last {limit} tokens"
                    if what == "the prompt" else "; shorten it")
            raise CapacityError(f"{what} is {n_tokens} tokens, more than the context limit of "
                                f"{limit} tokens{hint}")

    @property
    def grammar(self) -> TokenGrammar:
        """The vocabulary prepared for constrained decoding (built on first use, ~0.2 s)."""
        if self._grammar is None:
            self._grammar = TokenGrammar(self.model.tokenizer)
        return self._grammar

    def truncated(self, ids: list[int], limit: int) -> list[int]:
        """The last `limit` ids, behind the BOS token if the prompt starts with one."""
        if len(ids) <= limit:
            return ids
        bos = self.model.tokenizer.bos_id
        head = ids[:1] if ids[0] == bos and self.model.tokenizer.add_bos else []
        return head + ids[len(ids) - (limit - len(head)):]

    def start_generation(self, ids: list[int], opts: GenOptions, *,
                         prompt_logprobs: bool = False, constraint=None) -> Handle:
        """Submit a generation. A prompt over the context limit is a 400 naming both numbers
        unless `opts.truncate`; `max_tokens` is capped at the room left (finish "length")."""
        t0 = time.perf_counter()
        if not ids:
            raise ConfigError("prompt", "is empty after tokenization")
        check_ids(ids, self.model.config.vocab_size)
        limit = opts.num_ctx or self.context_length
        max_tokens = opts.max_tokens if opts.max_tokens is not None else self.config.max_tokens
        if opts.truncate:  # keep room for the answer: the tokens asked for, at most half
            reserve = max(1, min(max_tokens or limit, limit // 2))
            ids = self.truncated(ids, limit - reserve + 1)
        self.check_fits(len(ids), limit)
        room = limit - len(ids) + 1  # the last sampled token is never fed back
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        session_kw = self.session_kw(opts.kv_budget, opts.cache_salt, longest=limit,
                                     context_limit=limit)
        fmt = opts.json_format
        if fmt is not None and constraint is not None:
            raise ConfigError(fmt.field, "cannot be combined with a forced tool call")
        if fmt is not None:
            constraint = self.grammar.constraint(fmt.schema, fmt.field)
        spec = GenerationSpec(tuple(ids), opts.sampling, max_tokens, opts.stops, session_kw,
                              constraint=constraint, logprobs=opts.logprobs,
                              prompt_logprobs=prompt_logprobs)
        return self._submit(lambda ch: GenerationJob(self.model, spec, ch), t0)

    def start_embedding(self, inputs: list[str | list[int]], kv_budget: int | str | None = None,
                        cache_salt: str | None = None) -> Handle:
        """Embed texts (tokenized here, as text) or token-id lists, one chunk per step. Each
        input's Session is sized to it, so a percentage budget is of that input's full K/V
        (checked against the ceiling for the longest)."""
        t0 = time.perf_counter()
        inputs = [self.tokenize(x) if isinstance(x, str) else x for x in inputs]
        for i, ids in enumerate(inputs):
            if not ids:
                raise ConfigError("input", f"item {i} is empty")
            check_ids(ids, self.model.config.vocab_size)
            self.check_fits(len(ids), self.context_length, f"input {i}")
        total = sum(map(len, inputs))
        if total > self.config.max_embed_tokens:
            raise ConfigError("input", f"is {total} tokens in all, more than this server's "
                                       f"limit of {self.config.max_embed_tokens} per request")
        session_kw = self.session_kw(kv_budget, cache_salt, longest=max(map(len, inputs)))
        return self._submit(lambda ch: EmbeddingJob(self.model, inputs, ch, session_kw), t0)

    def _submit(self, make, t0: float) -> Handle:
        channel = Channel(asyncio.get_running_loop())
        job = make(channel)
        self.scheduler.submit(job)
        return Handle(self.scheduler, job, channel, t0)
