"""Tool calling on the text side: does a chat template render tools, and what did the model call.

Holds `supports_tools` (render a probe tool through the template: the template supports tools
if the probe's name appears in the prompt), the parser of the `<tool_call>{"name", "arguments"}
</tool_call>` blocks that Qwen2.5 / Hermes-style templates ask for (`parse_tool_calls`,
`ToolText` for streams: content is released until a block may begin, the blocks are parsed at
the end), and `forced_call_grammar` (a Lark grammar for llguidance that makes the model emit one
such block for one of the given tools: OpenAI's `tool_choice` "required" or a named function).
It does not render prompts (chat.py) or know HTTP shapes.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from cfr_atlas.errors import AtlasError

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
_PROBE = "cfr_atlas_probe_tool"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


def supports_tools(template) -> bool:
    """True if `template` (a ChatTemplate) writes a tool's definition into the prompt."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "probe",
                                               "parameters": {"type": "object"}}}]
    try:
        text = template.render([{"role": "user", "content": "hi"}], tools=probe)
    except AtlasError:
        return False
    return _PROBE in text


def _call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    args = value.get("arguments", value.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(value["name"], args) if isinstance(args, dict) else None


def _bare_calls(text: str, names) -> list[ToolCall]:
    """A whole answer that is one call object (or a list of them) naming known tools, without
    the tags (what small Qwen2.5 models often write): its calls, else []."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call(json.dumps(v)) for v in items]
    if not calls or any(c is None or c.name not in names for c in calls):
        return []
    return calls


def parse_tool_calls(text: str, names=None) -> tuple[str, list[ToolCall]]:
    """(the text without its well-formed tool-call blocks, stripped; the calls in order).
    A block whose body is not {"name": str, "arguments": object} stays in the text. Given the
    tools' `names`, an answer that is nothing but such an object (or a list) naming one of
    them is a call too."""
    if names and text.strip()[:1] in ("{", "[") and OPEN not in text:
        calls = _bare_calls(text.strip(), set(names))
        if calls:
            return "", calls
    calls: list[ToolCall] = []

    def take(m: re.Match) -> str:
        call = _call(m.group(1))
        if call is None:
            return m.group(0)
        calls.append(call)
        return ""

    rest = _BLOCK.sub(take, text)
    return (rest.strip() if calls else rest), calls


class ToolText:
    """A generation's text pieces -> content safe to stream now; tool calls at the end.

    Text is released until `<tool_call>` may begin (a trailing prefix of it is held back);
    from there on everything is held and parsed by `finish()`. An answer whose first
    non-blank character is `{` or `[` is held whole (it may be a bare call object).
    """

    def __init__(self, names=None):
        self._held = ""
        self._in_call = False
        self._names = names
        self._released = False  # visible text was sent: a bare call can no longer start

    def push(self, piece: str) -> str:
        if self._in_call:
            self._held += piece
            return ""
        text = self._held + piece
        if self._names and text.strip()[:1] in ("{", "[") and not self._released:
            self._in_call, self._held = True, text
            return ""
        if text.strip():
            self._released = True
        at = text.find(OPEN)
        if at >= 0:
            self._in_call, self._held = True, text[at:]
            return text[:at]
        keep = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1)
                     if OPEN.startswith(text[-n:])), 0)
        self._held = text[len(text) - keep:]
        return text[:len(text) - keep]

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(content still held back, the calls); a malformed block comes back as content."""
        held, self._held = self._held, ""
        return parse_tool_calls(held, self._names)


def forced_call_grammar(tools: list[dict], name: str | None = None) -> str:
    """Lark for llguidance: one `<tool_call>` block calling `name` (None: any of `tools`)
    with arguments matching the tool's `parameters` schema."""
    options = []
    for tool in tools:
        fn = tool["function"]
        if name is not None and fn["name"] != name:
            continue
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]},
                                                         "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema["x-guidance"] = {"whitespace_flexible": False}
    return (f'start: "{OPEN}\\n" call "\\n{CLOSE}"\n'
            f"call: %json {json.dumps(schema)}\n")
