"""Chat templates: turn a list of messages into the prompt string a model was tuned on.

Holds `ChatTemplate` (Jinja2 in an `ImmutableSandboxedEnvironment` with the helpers HF
templates expect: `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII, loop
controls, trim_blocks/lstrip_blocks), message validation, and `CHATML_TEMPLATE`, used when
the GGUF has no `tokenizer.chat_template`.

`ChatTemplate.encode` turns messages into token ids so that only the template's own literals
become control tokens. Before rendering, every added-token text inside a message's string
values (and a leading / trailing fragment of one, which could join the template's text) is
swapped for a private-use character that occurs nowhere in the template, the messages or the
vocabulary's added tokens. The rendered string is cut at added-token texts (all of them the
template's now); the pieces between are restored and encoded as plain text. For messages with
no such text the ids are exactly `encode(render(...), special=True)`. Last, the control tokens
found must be those the template produces around neutral messages (one stand-in per string):
message text that the escapes cannot see forming a control token (an infix between two
template literals, a fragment a `trim` filter exposes) is refused with a ConfigError.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from cfr_atlas.errors import ConfigError, NoChatTemplateError
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


_PRIVATE_USE = (range(0xE000, 0xF900), range(0xF0000, 0xFFFFE), range(0x100000, 0x10FFFE))


class _Escapes:
    """Added-token texts in untrusted strings <-> private-use stand-ins (one per distinct text).

    A stand-in is a character absent from everything the template can see and from every
    added token, so no added-token match can include it and restoring it is exact.
    """

    def __init__(self, tokenizer: Tokenizer, seen: str):
        self._tok = tokenizer
        texts = tokenizer.added_texts
        self._prefixes = {t[:n] for t in texts for n in range(1, len(t))}
        self._suffixes = {t[n:] for t in texts for n in range(1, len(t))}
        self._longest = max(map(len, texts), default=0)
        taken = set(seen).union(*texts)
        self._free = (chr(c) for r in _PRIVATE_USE for c in r if chr(c) not in taken)
        self._code: dict[str, str] = {}
        self._restore: dict[int, str] = {}

    def _stand_in(self, text: str) -> str:
        if text not in self._code:
            code = next(self._free, None)
            if code is None:
                raise ConfigError("messages", "too many distinct special-token texts to escape")
            self._code[text], self._restore[ord(code)] = code, text
        return self._code[text]

    def escape(self, s: str) -> str:
        """`s` with no added-token text inside it and none that can form across its ends."""
        parts = [p if isinstance(p, str) else self._stand_in(self._tok.id_to_token(p))
                 for p in self._tok.split_special(s)]
        s = "".join(parts)
        if any(s[:n] in self._suffixes for n in range(1, min(len(s), self._longest) + 1)):
            s = self._stand_in(s[0]) + s[1:]
        if any(s[-n:] in self._prefixes for n in range(1, min(len(s), self._longest) + 1)):
            s = s[:-1] + self._stand_in(s[-1])
        return s

    def value(self, v):
        """`v` with every string inside it escaped, dict keys included (dicts and lists walked:
        tool calls and tool definitions carry client text too, and templates print them whole
        with `tojson`, keys and all)."""
        if isinstance(v, str):
            return self.escape(v)
        if isinstance(v, Mapping):
            return {self.value(k): self.value(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [self.value(x) for x in v]
        return v

    def message(self, m: dict) -> dict:
        return self.value(m)

    def neutral(self, m: dict) -> dict:
        """`m` with every string but the role replaced by one stand-in character: what the
        template renders when messages hold nothing that could touch its control tokens."""
        blank = self._stand_in("")
        return {k: blank if isinstance(v, str) and k != "role" else v for k, v in m.items()}

    def restore(self, s: str) -> str:
        return s.translate(self._restore) if self._restore else s


def _seen(template: str, messages: list[dict], context: dict) -> str:
    """Every character the template or its inputs contain (stand-ins must avoid them all)."""
    strings = json.dumps(messages, ensure_ascii=False, default=str)
    return template + strings + json.dumps(context, ensure_ascii=False, default=str)


def _control_ids(parts: list) -> list[int]:
    return [p for p in parts if isinstance(p, int)]


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
        if not found and "<|im_start|>" not in tokenizer.added_texts:
            return MissingChatTemplate("", bos, eos)  # a base model: chat is refused, typed
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

    def encode(self, tokenizer: Tokenizer, messages, add_generation_prompt: bool = True,
               **context) -> list[int]:
        """messages -> prompt ids; text in the messages never becomes a control token.

        Only the template's own literals (and `bos_token` / `eos_token`) are special-parsed;
        BOS / EOS are added per the GGUF metadata, as `tokenizer.encode` adds them.
        """
        messages = validate_messages(messages)
        escapes = _Escapes(tokenizer, _seen(self.template, messages, context))
        messages = [escapes.message(m) for m in messages]
        context = escapes.value(context)
        text = self.render(messages, add_generation_prompt, **context)
        parts = tokenizer.split_special(text)
        # The check that makes the promise hold for any template: the control tokens must be
        # those of the same template around neutral messages. Text the escapes cannot see
        # (an infix between two template literals, a fragment exposed by a `trim` filter)
        # would change them: refused rather than tokenized as a control token.
        neutral = self.render([escapes.neutral(m) for m in messages], add_generation_prompt,
                              **context)
        if _control_ids(parts) != _control_ids(tokenizer.split_special(neutral)):
            raise ConfigError("messages", "message text would form a control token together "
                                          "with the chat template's own text; remove "
                                          "special-token fragments from the messages")
        ids: list[int] = []
        for part in parts:
            if isinstance(part, int):
                ids.append(part)
            else:
                ids += tokenizer.encode(escapes.restore(part), add_bos=False, add_eos=False)
        return tokenizer.wrap(ids)


class MissingChatTemplate(ChatTemplate):
    """What a GGUF without `tokenizer.chat_template` and without ChatML tokens gets (a base
    model such as Gemma 3 270M): rendering raises `NoChatTemplateError`; raw prompts still work."""

    def render(self, messages, add_generation_prompt: bool = True, **context) -> str:
        raise NoChatTemplateError(
            "this model's GGUF has no tokenizer.chat_template and no ChatML tokens (a base "
            f"model?): chat is not available for {len(messages)} message(s); send a raw prompt "
            "(cfr-atlas generate --raw, /api/generate with raw, /v1/completions)")

    def encode(self, tokenizer: Tokenizer, messages, add_generation_prompt: bool = True,
               **context) -> list[int]:
        self.render(messages)  # raises
        return []
