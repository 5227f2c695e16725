"""Request validation: typed field readers and the generation options of both APIs.

Everything a client sends is checked here, at the boundary, and turned into plain values or a
`GenOptions`; a bad value raises `ConfigError(field, message)` naming the field and the value,
which the server answers with 400. Unknown fields are ignored (clients send many knobs we do
not have); known fields of the wrong type or range are refused. Sizes are bounded here too:
integers to the int64 range, `stop` to MAX_STOPS strings of MAX_STOP_CHARS, embedding inputs
to MAX_EMBED_INPUTS, `cache_salt` to MAX_SALT_CHARS. No model work happens here.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cfr_atlas.errors import ConfigError
from cfr_atlas.logprobs import MAX_TOP
from cfr_atlas.models.session import check_kv_budget
from cfr_atlas.sampling import SamplingParams

_MISSING = object()
INT_LIMIT = 2**63 - 1  # any integer field: |value| <= this (int64), else a 400
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 256  # characters per stop string
MAX_EMBED_INPUTS = 2048  # inputs per embedding request (OpenAI's own limit)
MAX_SALT_CHARS = 256  # cache_salt length
MAX_COMPLETION_TOP = 5  # /v1/completions `logprobs` (OpenAI's limit)


def _short(value, limit: int = 80) -> str:
    """repr(value) cut to `limit` characters (a client's value can be megabytes long)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"a {value.bit_length()}-bit integer"  # repr of a huge int is slow and long
    if isinstance(value, list | dict) and len(value) > limit:
        return f"a {type(value).__name__} of {len(value)} items"
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _type_name(value) -> str:
    return "null" if value is None else type(value).__name__


def get_str(body: Mapping, key: str, default=_MISSING, *, where: str = "") -> str | None:
    """body[key] as a str; missing (or null) -> default, or a ConfigError if required."""
    value = body.get(key)
    if value is None:
        if default is _MISSING:
            raise ConfigError(where + key, "is required")
        return default
    if not isinstance(value, str):
        raise ConfigError(where + key, f"must be a string, got {_type_name(value)}")
    return value


def get_bool(body: Mapping, key: str, default: bool, *, where: str = "") -> bool:
    value = body.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ConfigError(where + key, f"must be true or false, got {_short(value)}")
    return value


def get_number(body: Mapping, key: str, default=None, *, where: str = "") -> float | None:
    """A finite int or float (never a bool or a numeric string)."""
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(where + key, f"must be a number, got {_short(value)}")
    if isinstance(value, int) and abs(value) > INT_LIMIT:
        raise ConfigError(where + key, f"must be within +-{INT_LIMIT} (int64), got a "
                                       f"{value.bit_length()}-bit integer")
    if not math.isfinite(value):
        raise ConfigError(where + key, f"must be a finite number, got {value!r}")
    return value


def get_int(body: Mapping, key: str, default=None, *, where: str = "") -> int | None:
    """An int; a float with an integral value (4.0) is accepted as that int."""
    value = get_number(body, key, where=where)
    if value is None:
        return default
    if isinstance(value, float):
        if not value.is_integer() or abs(value) > INT_LIMIT:
            raise ConfigError(where + key, f"must be an integer within +-{INT_LIMIT}, got "
                                           f"{value!r}")
        value = int(value)
    return value


def get_object(body: Mapping, key: str, *, where: str = "") -> Mapping:
    value = body.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(where + key, f"must be an object, got {_type_name(value)}")
    return value


def get_stops(body: Mapping, key: str, *, where: str = "") -> tuple[str, ...]:
    """A string or a list of at most MAX_STOPS strings of at most MAX_STOP_CHARS each."""
    value = body.get(key)
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ConfigError(where + key, f"must be a string or a list of strings, got "
                                       f"{_short(value)}")
    if len(stops) > MAX_STOPS:
        raise ConfigError(where + key, f"has {len(stops)} strings; at most {MAX_STOPS}")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise ConfigError(where + key, f"has a {longest}-character string; at most "
                                       f"{MAX_STOP_CHARS} characters each")
    return tuple(stops)


def get_cache_salt(body: Mapping, key: str = "cache_salt", *, where: str = "") -> str | None:
    """A prefix-cache salt: 1 to MAX_SALT_CHARS characters, or absent (None)."""
    salt = get_str(body, key, None, where=where)
    if salt is not None and not 1 <= len(salt) <= MAX_SALT_CHARS:
        raise ConfigError(where + key, f"must be 1 to {MAX_SALT_CHARS} characters, got "
                                       f"{len(salt)}")
    if salt is not None and not salt.isascii():
        try:
            salt.encode("utf-8")
        except UnicodeEncodeError:
            raise ConfigError(where + key, "is not valid Unicode text (lone surrogate)") from None
    return salt


log = logging.getLogger("cfr_atlas.serve")
# Fields clients commonly send that change nothing here: accepted, with one warning per field in
# the server log (docs/SERVING.md lists them). Anything else unknown is ignored silently.
IGNORED_OLLAMA_OPTIONS = frozenset({
    "num_thread", "num_gpu", "main_gpu", "num_batch", "num_keep", "numa", "use_mmap",
    "use_mlock", "low_vram", "vocab_only", "penalize_newline"})
# Sampling options we do not implement, with the value at which they change nothing (Ollama's
# defaults): sent at that value they are accepted with a warning, any other value is a 400,
# since ignoring it would change the output silently.
UNSUPPORTED_OLLAMA_SAMPLING = {"mirostat": 0, "mirostat_eta": 0.1, "mirostat_tau": 5.0,
                               "typical_p": 1.0, "tfs_z": 1.0, "presence_penalty": 0.0,
                               "frequency_penalty": 0.0}
IGNORED_OLLAMA = frozenset({"think", "shift"})
IGNORED_OPENAI = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls",
                            "reasoning_effort", "modalities", "prediction", "safety_identifier",
                            "prompt_cache_key", "verbosity"})
_warned: set[str] = set()


def _refuse_unsupported_sampling(opts: Mapping, where: str) -> None:
    """400 for a sampling option we do not implement set to a value that would matter."""
    for key, neutral in UNSUPPORTED_OLLAMA_SAMPLING.items():
        value = get_number(opts, key, where=where)
        if value is not None and value != neutral:
            raise ConfigError(where + key, f"is not supported (only {neutral}, which changes "
                                           f"nothing); got {value!r}: use temperature, top_k, "
                                           f"top_p, min_p or repeat_penalty")
    warn_ignored(opts, frozenset(UNSUPPORTED_OLLAMA_SAMPLING), where)


def warn_ignored(body: Mapping, keys: frozenset, where: str = "") -> None:
    """Log (once per field) the known fields in `body` that this server accepts but ignores."""
    for key in keys.intersection(body) - _warned:
        _warned.add(key)
        log.warning("ignoring the request field %s%s (no effect in cfr-atlas; logged once)",
                    where, key)


def refuse(body: Mapping, key: str, why: str) -> None:
    """A feature we do not implement: refuse a truthy value instead of silently ignoring it."""
    if body.get(key):
        raise ConfigError(key, f"is not supported by cfr-atlas ({why})")


@dataclass(frozen=True)
class GenOptions:
    """Validated generation options shared by both APIs."""

    sampling: SamplingParams
    max_tokens: int | None  # None: until the context is full (or the server's default)
    stops: tuple[str, ...] = ()
    num_ctx: int | None = None  # context limit for this request; None: the model's
    kv_budget: int | str | None = None  # bytes or "10%"; None: the server's --kv-budget
    cache_salt: str | None = None  # prefix-cache isolation key; None: the shared, unsalted one
    json_format: JsonFormat | None = None  # structured output; None: free text
    logprobs: int | None = None  # None: off; else alternatives per token (0 to MAX_TOP)
    truncate: bool = False  # a prompt over the context limit keeps its end instead of a 400


@dataclass(frozen=True)
class JsonFormat:
    """Structured output: JSON matching `schema` (None: any JSON object); `field` names the
    request field it came from, for errors."""

    schema: Mapping | None
    field: str


def _sampling(src: Mapping, where: str) -> SamplingParams:
    """Engine defaults (greedy, every filter off) for whatever the client leaves out."""
    seed = get_int(src, "seed", where=where)
    kw = {
        "temperature": get_number(src, "temperature", 0.0, where=where),
        "top_k": get_int(src, "top_k", 0, where=where),
        "top_p": get_number(src, "top_p", 1.0, where=where),
        "min_p": get_number(src, "min_p", 0.0, where=where),
        "repeat_penalty": get_number(src, "repeat_penalty", 1.0, where=where),
        "repeat_last_n": get_int(src, "repeat_last_n", 64, where=where),
        "seed": None if seed == -1 else seed,  # Ollama: -1 = a random seed
    }
    try:
        return SamplingParams(**kw)
    except ConfigError as e:
        raise ConfigError(where + e.field, str(e).split(": ", 1)[1]) from None


def _num_ctx(src: Mapping, where: str, context_length: int) -> int | None:
    n = get_int(src, "num_ctx", where=where)
    if n is not None and not 1 <= n <= context_length:
        raise ConfigError(where + "num_ctx", f"must be in [1, {context_length}] (the model's "
                                             f"context length), got {n}")
    return n


def kv_budget(src: Mapping, where: str = "") -> int | str | None:
    """`kv_budget`: a byte count, a size ("4MiB") or a share of the full K/V at the request's
    context limit ("10%"), kept as text until the service resolves it against that limit."""
    value = src.get("kv_budget")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise ConfigError(where + "kv_budget", f"must be a size such as \"4MiB\", a byte "
                                               f"count or a percentage such as \"10%\", got "
                                               f"{_short(value)}")
    try:
        return check_kv_budget(value)
    except ConfigError as e:
        raise ConfigError(where + "kv_budget", str(e).split(": ", 1)[1]) from None


def ollama_options(body: Mapping, context_length: int) -> GenOptions:
    """`options` of /api/generate and /api/chat (temperature, num_predict, stop, ...)."""
    opts = get_object(body, "options")
    where = "options."
    warn_ignored(opts, IGNORED_OLLAMA_OPTIONS, where)
    warn_ignored(body, IGNORED_OLLAMA)
    _refuse_unsupported_sampling(opts, where)
    n = get_int(opts, "num_predict", where=where)
    if n is not None and n < -1:
        raise ConfigError(where + "num_predict", f"must be >= 0, or -1 for 'until the context "
                                                 f"is full', got {n}")
    return GenOptions(
        sampling=_sampling(opts, where),
        max_tokens=None if n is None or n == -1 else n,
        stops=get_stops(opts, "stop", where=where),
        num_ctx=_num_ctx(opts, where, context_length),
        kv_budget=kv_budget(opts, where),
        cache_salt=ollama_salt(body),
        json_format=ollama_format(body),
        logprobs=_top_logprobs(body, get_bool(body, "logprobs", False), MAX_TOP),
        truncate=get_bool(body, "truncate", False),
    )


def ollama_format(body: Mapping) -> JsonFormat | None:
    """`format`: "json" (any JSON object), a JSON schema object, or absent / "" (free text)."""
    value = body.get("format")
    if value is None or value == "":
        return None
    if value == "json":
        return JsonFormat(None, "format")
    if isinstance(value, Mapping):
        return JsonFormat(value, "format")
    raise ConfigError("format", f"must be \"json\" or a JSON schema object, got {_short(value)}")


def _top_logprobs(body: Mapping, on: bool, limit: int, key: str = "top_logprobs") -> int | None:
    """None when log-probabilities are off; else `top_logprobs` in [0, limit] (default 0)."""
    n = get_int(body, key, 0)
    if not 0 <= n <= limit:
        raise ConfigError(key, f"must be in [0, {limit}], got {n}")
    if n and not on:
        raise ConfigError(key, "needs logprobs: true")
    return n if on else None


def ollama_salt(body: Mapping) -> str | None:
    """Ollama requests: `cache_salt` at the top level or in `options` (the `ollama` package
    can only send the latter); both must agree."""
    top = get_cache_salt(body)
    inner = get_cache_salt(get_object(body, "options"), where="options.")
    if top is not None and inner is not None and top != inner:
        raise ConfigError("cache_salt", "differs from options.cache_salt; send one of them")
    return top if top is not None else inner


def openai_options(body: Mapping, context_length: int, *, chat: bool = True) -> GenOptions:
    """Top-level sampling fields of /v1/chat/completions and /v1/completions.

    Extensions beyond OpenAI's set: top_k, min_p, repeat_penalty, repeat_last_n, num_ctx,
    kv_budget (send them with the SDK's `extra_body`).
    """
    n = get_int(body, "max_completion_tokens")
    n = get_int(body, "max_tokens") if n is None else n
    if n is not None and n < 0:
        raise ConfigError("max_tokens", f"must be >= 0, got {n}")
    count = get_int(body, "n", 1)
    if count != 1:
        raise ConfigError("n", f"only n=1 is supported, got {count}")
    for key in ("presence_penalty", "frequency_penalty"):
        if get_number(body, key, 0.0) != 0.0:
            raise ConfigError(key, "is not supported by cfr-atlas; use repeat_penalty")
    refuse(body, "logit_bias", "no logit bias")
    warn_ignored(body, IGNORED_OPENAI)
    return GenOptions(
        sampling=_sampling(body, ""),
        max_tokens=n,
        stops=get_stops(body, "stop"),
        num_ctx=_num_ctx(body, "", context_length),
        kv_budget=kv_budget(body),
        cache_salt=get_cache_salt(body),
        json_format=response_format(body),
        logprobs=(_top_logprobs(body, get_bool(body, "logprobs", False), MAX_TOP) if chat
                  else _completion_logprobs(body)),
        truncate=get_bool(body, "truncate", False),
    )


def _completion_logprobs(body: Mapping) -> int | None:
    """/v1/completions `logprobs`: null (off) or the number of alternatives, 0 to 5."""
    n = get_int(body, "logprobs")
    if n is not None and not 0 <= n <= MAX_COMPLETION_TOP:
        raise ConfigError("logprobs", f"must be in [0, {MAX_COMPLETION_TOP}], got {n}")
    return n


def response_format(body: Mapping) -> JsonFormat | None:
    """`response_format`: {"type": "text"}, {"type": "json_object"} or {"type": "json_schema",
    "json_schema": {"name", "schema", "strict"}}. The schema is always enforced (`strict` or
    not: a grammar is the only way we produce JSON)."""
    fmt = get_object(body, "response_format")
    kind = get_str(fmt, "type", "text", where="response_format.")
    if kind == "text":
        return None
    if kind == "json_object":
        return JsonFormat(None, "response_format")
    if kind != "json_schema":
        raise ConfigError("response_format.type", f"must be 'text', 'json_object' or "
                                                  f"'json_schema', got {_short(kind)}")
    spec = get_object(fmt, "json_schema", where="response_format.")
    get_bool(spec, "strict", False, where="response_format.json_schema.")
    schema = spec.get("schema")
    if not isinstance(schema, Mapping):
        raise ConfigError("response_format.json_schema.schema",
                          f"must be a JSON schema object, got {_short(schema)}")
    return JsonFormat(schema, "response_format.json_schema.schema")


_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
          "tool": "tool"}


def _content(message: Mapping, where: str) -> str:
    """A message's text: a string, null, or OpenAI's list of {"type": "text"} parts."""
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind != "text":
                raise ConfigError(f"{where}content[{j}]", f"only text parts are supported, got "
                                                          f"{kind or _type_name(part)!r}")
            parts.append(get_str(part, "text", where=f"{where}content[{j}]."))
        return "".join(parts)
    raise ConfigError(where + "content", f"must be a string, got {_type_name(content)}")


def chat_messages(body: Mapping) -> list[dict]:
    """`messages` as [{"role", "content"}]: non-empty, known roles, text only."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ConfigError("messages", f"must be a non-empty list of {{role, content}} objects, "
                                      f"got {_short(messages)}")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]."
        if not isinstance(m, Mapping):
            raise ConfigError(where[:-1], f"must be an object, got {_type_name(m)}")
        role = get_str(m, "role", where=where)
        if role not in _ROLES:
            raise ConfigError(where + "role", f"must be one of {sorted(_ROLES)}, got "
                                              f"{_short(role)}")
        if m.get("images"):
            raise ConfigError(where + "images", "is not supported (the model reads text only)")
        out.append({"role": _ROLES[role], "content": _content(m, where),
                    **_tool_fields(m, role, where)})
    return out


def _arguments(value, where: str) -> dict:
    """A tool call's arguments: an object (Ollama) or a JSON string of one (OpenAI)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise ConfigError(where, f"is not valid JSON: {_short(value)}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(where, f"must be an object (or a JSON string of one), got "
                                 f"{_short(value)}")
    return dict(value)


def _tool_fields(m: Mapping, role: str, where: str) -> dict:
    """What a template needs of tool traffic: an assistant's `tool_calls` (arguments as
    objects), a tool message's `tool_call_id` / `name`."""
    out = {}
    calls = m.get("tool_calls")
    if calls is not None and role == "assistant":
        if not isinstance(calls, list):
            raise ConfigError(where + "tool_calls", f"must be a list, got {_short(calls)}")
        out["tool_calls"] = []
        for j, call in enumerate(calls):
            w = f"{where}tool_calls[{j}]."
            fn = get_object(call if isinstance(call, Mapping) else {}, "function", where=w)
            entry = {"type": "function", "function": {
                "name": get_str(fn, "name", where=w + "function."),
                "arguments": _arguments(fn.get("arguments", {}), w + "function.arguments")}}
            if isinstance(call, Mapping) and isinstance(call.get("id"), str):
                entry["id"] = call["id"]
            out["tool_calls"].append(entry)
    if role == "tool":
        for key in ("tool_call_id", "name", "tool_name"):
            value = get_str(m, key, None, where=where)
            if value is not None:
                out[key] = value
    return out


MAX_TOOLS = 128  # tools per request


def get_tools(body: Mapping) -> list[dict] | None:
    """`tools`: [{"type": "function", "function": {"name", "description", "parameters"}}]
    (both APIs); None when absent or empty."""
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ConfigError("tools", f"must be a list of at most {MAX_TOOLS} tool objects, got "
                                   f"{_short(tools)}")
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]."
        if not isinstance(tool, Mapping):
            raise ConfigError(where[:-1], f"must be an object, got {_type_name(tool)}")
        kind = get_str(tool, "type", "function", where=where)
        if kind != "function":
            raise ConfigError(where + "type", f"only 'function' tools are supported, got "
                                              f"{_short(kind)}")
        fn = get_object(tool, "function", where=where)
        name = get_str(fn, "name", where=where + "function.")
        params = get_object(fn, "parameters", where=where + "function.")
        desc = get_str(fn, "description", "", where=where + "function.")
        out.append({"type": "function", "function": {"name": name, "description": desc,
                                                     "parameters": dict(params)}})
    return out


def tool_choice(body: Mapping, tools: list[dict] | None) -> tuple[bool, str | None]:
    """OpenAI `tool_choice` -> (use the tools, force a call: "*" any, a name, or None).
    "none" drops the tools; "auto" (default) lets the model choose."""
    value = body.get("tool_choice")
    if value is None or value == "auto":
        return tools is not None, None
    if value == "none":
        return False, None
    if tools is None:
        raise ConfigError("tool_choice", "needs tools")
    if value == "required":
        return True, "*"
    fn = get_object(value if isinstance(value, Mapping) else {}, "function",
                    where="tool_choice.")
    name = get_str(fn, "name", None, where="tool_choice.function.")
    if not isinstance(value, Mapping) or name is None:
        raise ConfigError("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": "
                                         "\"function\", \"function\": {\"name\": ...}}, got "
                                         + _short(value))
    if name not in [t["function"]["name"] for t in tools]:
        raise ConfigError("tool_choice.function.name", f"{name!r} is not one of the tools")
    return True, name


_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"^(-?)((?:\d+(?:\.\d*)?(?:ns|us|µs|ms|s|m|h))+)$")
DEFAULT_KEEP_ALIVE = 300.0  # seconds (Ollama's 5m)


KEEP_ALIVE_FOREVER = 10 * 365 * 86400.0  # seconds; longer is forever (-1), as an expiry
# date that far out overflows what /api/ps can print


def keep_alive(body: Mapping) -> float | None:
    """Ollama `keep_alive`: seconds (a number) or a Go duration ("5m", "1h30m", "-1s");
    None when absent (the default applies). Negative, non-finite or over ten years: forever
    (-1); 0: unload now."""
    seconds = _keep_alive_seconds(body)
    if seconds is not None and (seconds < 0 or not seconds <= KEEP_ALIVE_FOREVER):
        return -1.0
    return seconds


def _keep_alive_seconds(body: Mapping) -> float | None:
    value = body.get("keep_alive")
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"-?\d+(\.\d+)?", text):
            return float(text)
        m = _DURATION.match(text)
        if m is None:
            raise ConfigError("keep_alive", f"must be seconds or a duration such as \"5m\", "
                                            f"got {_short(value)}")
        parts = re.findall(r"(\d+(?:\.\d*)?)(ns|us|µs|ms|s|m|h)", m.group(2))
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
        return -seconds if m.group(1) else seconds
    return float(get_number(body, "keep_alive"))


def get_dimensions(body: Mapping, dim: int) -> int | None:
    """`dimensions` of an embedding request: keep the first d components (renormalized)."""
    d = get_int(body, "dimensions")
    if d is not None and not 1 <= d <= dim:
        raise ConfigError("dimensions", f"must be in [1, {dim}] (the model's width), got {d}")
    return d


def embed_inputs(body: Mapping, key: str, *, token_ids: bool) -> list[str | list[int]]:
    """A string or a non-empty list of strings; with `token_ids`, also a list of ints or a list
    of such lists (OpenAI's pre-tokenized input)."""
    value = body.get(key)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and len(value) > MAX_EMBED_INPUTS:
        raise ConfigError(key, f"has {len(value)} items; at most {MAX_EMBED_INPUTS} per request")
    if isinstance(value, list) and value:
        if all(isinstance(v, str) for v in value):
            return list(value)
        if token_ids and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return [list(value)]
        if token_ids and all(isinstance(v, list) and all(isinstance(t, int)
                                                         and not isinstance(t, bool) for t in v)
                             for v in value):
            return [list(v) for v in value]
    kinds = "a string or a non-empty list of strings" + (
        " (or of token ids)" if token_ids else "")
    raise ConfigError(key, f"must be {kinds}, got {_short(value)}")
