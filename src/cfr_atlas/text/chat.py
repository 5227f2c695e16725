"""Chat templates: turn a list of messages into the prompt string a model was tuned on.

Holds `ChatTemplate` (Jinja2 in an `ImmutableSandboxedEnvironment` with the helpers HF
templates expect: `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, loop
controls, trim_blocks/lstrip_blocks), message validation, and `CHATML_TEMPLATE`, used when
the GGUF has no `tokenizer.chat_template`. It does not tokenize: the rendered string goes
through `Tokenizer.encode`, which maps `<|im_start|>` and friends to single ids.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cfr_atlas.errors import ConfigError
from cfr_atlas.text import gguf_meta as meta
from cfr_atlas.text.tokenizer import Tokenizer

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise_exception(message: str):
    raise ConfigError("messages", f"rejected by the chat template: {message}")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Check `messages` is a list of dicts with str 'role' and 'content'; return plain dicts."""
    if isinstance(messages, str | bytes | Mapping) or not isinstance(messages, Sequence):
        raise ConfigError("messages", f"must be a list of dicts, got {type(messages).__name__}")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ConfigError("messages", f"item {i} must be a dict, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = type(message.get(key)).__name__ if key in message else "nothing"
                raise ConfigError("messages", f"item {i}: {key!r} must be a str, got {got}")
        checked.append(dict(message))
    return checked


def _token_text(tokenizer: Tokenizer, token_id: int | None) -> str:
    return "" if token_id is None else tokenizer.decode([token_id])


class ChatTemplate:
    """A compiled chat template plus the BOS/EOS strings templates refer to."""

    def __init__(self, template: str, bos_token: str = "", eos_token: str = ""):
        if not isinstance(template, str):
            raise ConfigError("chat_template", f"must be a str, got {type(template).__name__}")
        try:
            self._compiled = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as exc:
            raise ConfigError("chat_template", f"line {exc.lineno}: {exc.message}") from exc
        self.template = template
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_gguf(cls, source, tokenizer: Tokenizer) -> ChatTemplate:
        """From `tokenizer.chat_template` in a GGUFReader / fields mapping; ChatML if absent."""
        found = meta.read_fields(source, [meta.KEY_CHAT_TEMPLATE]).get(meta.KEY_CHAT_TEMPLATE)
        bos, eos = (_token_text(tokenizer, i) for i in (tokenizer.bos_id, tokenizer.eos_id))
        return cls(found or CHATML_TEMPLATE, bos, eos)

    def render(self, messages, add_generation_prompt: bool = True, **context) -> str:
        """messages: [{'role': str, 'content': str}, ...] -> the prompt text.

        Extra keyword arguments (e.g. `tools`) are passed to the template as variables.
        """
        variables = {"bos_token": self.bos_token, "eos_token": self.eos_token, **context}
        try:
            return self._compiled.render(
                messages=validate_messages(messages),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except (jinja2.TemplateError, TypeError) as exc:  # undefined names, bad operand types
            raise ConfigError("chat_template", f"rendering failed: {exc}") from exc
