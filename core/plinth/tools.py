"""Tool calling: tools into the prompt, a grammar when a call is required, calls out of the reply.

plinth's calls are written the way Qwen 2.5/3, Hermes and SmolLM3 are trained to write them: one
``<tool_call>`` block per call holding ``{"name": ..., "arguments": {...}}``. A chat template that
renders ``tools`` itself gets them (and the history's calls, arguments as objects); one that does not
(SmolLM2's, say) gets plinth's own tool section in the system message and the history's calls and
results written as those blocks. When a call is required (OpenAI ``tool_choice: "required"`` or a
named function, Anthropic ``any``/``tool``) the reply is constrained to such blocks, each call's
arguments to the tool's JSON schema; otherwise (``auto``) the model decides and the reply is parsed.
"""

from __future__ import annotations

import contextlib
import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from plinth.sampling_params import StructuredOutputs

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and its arguments' JSON schema."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None

    @property
    def schema(self) -> dict[str, Any]:
        """The arguments' schema (an object with no properties when the tool declares none)."""
        return self.parameters or {"type": "object", "properties": {}}

    def openai(self) -> dict[str, Any]:
        """The tool as chat templates take it (OpenAI's ``{"type": "function", "function": ...}``)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolCall:
    """A call parsed out of a reply: ``arguments`` is the JSON text of an object."""

    name: str
    arguments: str
    id: str = ""

    def with_id(self) -> ToolCall:
        """This call with a fresh ``call_...`` id (OpenAI's shape; Anthropic's ``toolu_...`` is the
        same id with another prefix)."""
        return ToolCall(self.name, self.arguments, self.id or f"call_{uuid.uuid4().hex[:24]}")


def template_renders_tools(template: str | None) -> bool:
    """True when a chat template reads ``tools`` (else plinth writes the tool section itself)."""
    return template is not None and re.search(r"\btools\b", template) is not None


def tools_system_text(tools: Sequence[Tool]) -> str:
    """plinth's tool section, for templates that do not render ``tools``."""
    listed = "\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help with the user's request. The functions, as JSON:\n"
        f"{listed}\n"
        f"To call one, reply with {CALL_OPEN}\n"
        '{"name": "<function name>", "arguments": {<the arguments, as its schema says>}}\n'
        f"{CALL_CLOSE} (one block per call). Otherwise reply in plain text."
    )


def chat_messages(
    messages: list[dict[str, Any]], tools: Sequence[Tool], template: str | None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The messages and template variables that put ``tools`` (and earlier calls and their results)
    before the model, for this chat ``template``."""
    out: list[dict[str, Any]] = []
    if template_renders_tools(template):
        for m in messages:
            m = dict(m)
            if m.get("tool_calls"):  # templates format the arguments themselves: give objects
                m["tool_calls"] = [_call_for_template(c) for c in m["tool_calls"]]
            out.append(m)
        return out, ({"tools": [t.openai() for t in tools]} if tools else {})
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [block(c["function"]["name"], c["function"]["arguments"]) for c in m.pop("tool_calls")]
            m["content"] = "\n".join(([m["content"]] if m.get("content") else []) + blocks)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content', '')}\n</tool_response>"}
        out.append(m)
    if tools:
        section = tools_system_text(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content', '')}\n\n{section}".strip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out, {}


def _call_for_template(call: dict[str, Any]) -> dict[str, Any]:
    function = dict(call.get("function", {}))
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):  # not JSON: the template gets the text
            function["arguments"] = json.loads(arguments)
    return {**call, "function": function}


def block(name: str, arguments: str | dict[str, Any]) -> str:
    """One call as plinth's format writes it. Arguments that are not JSON (a history may carry what a
    model wrote) go in as their text, as :func:`_call_for_template` hands them to a template."""
    args: Any = arguments
    if isinstance(arguments, str):
        with contextlib.suppress(ValueError):
            args = json.loads(arguments)
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': args}, ensure_ascii=False)}\n{CALL_CLOSE}"


def call_constraint(tools: Sequence[Tool], *, name: str | None = None, parallel: bool = True) -> StructuredOutputs:
    """The grammar of a reply that is only calls: one (``name`` given, or ``parallel`` False) or
    more blocks, each naming a tool with arguments valid against its schema."""
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        raise ValueError(f"no tool named {name!r}")
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": t.name}, "arguments": t.schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in chosen
    ]
    schema: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}}
    call = f"call: {json.dumps(CALL_OPEN + chr(10))} %json {json.dumps(schema)} {json.dumps(chr(10) + CALL_CLOSE)}"
    start = 'start: call ("\\n" call)*' if parallel and name is None else "start: call"
    return StructuredOutputs(grammar=f"{start}\n{call}\n")


def parse_tool_calls(text: str, tools: Sequence[Tool]) -> tuple[str | None, list[ToolCall]]:
    """Split a reply into its text and its calls. A block that is not a call of a known tool with
    object arguments stays in the text; an unclosed last block (cut by ``max_tokens``) is parsed too.

    :return: the text outside the calls (None when there is none) and the calls, with fresh ids.
    """
    names = {t.name for t in tools}
    calls: list[ToolCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = _parse_block(m.group(1), names)
        if call is None:
            continue
        kept.append(text[pos : m.start()])
        pos = m.end()
        calls.append(call.with_id())
    kept.append(text[pos:])
    content = "".join(kept).strip()
    return (content or None), calls


def _parse_block(body: str, names: set[str]) -> ToolCall | None:
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallStream:
    """Splits a streamed reply into text deltas and whole calls as the text grows.

    Text that may be the start of a ``<tool_call>`` block is held back; a block is handed out once
    its closing tag arrives (or the reply ends), as one call, or as text when it is not a call.
    """

    def __init__(self, tools: Sequence[Tool]) -> None:
        self._names = {t.name for t in tools}
        self._buffer = ""
        self.num_calls = 0

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        """Take the next piece of the reply; return the text to send now and the calls completed."""
        self._buffer += text
        out_text: list[str] = []
        calls: list[ToolCall] = []
        while self._buffer:
            start = self._buffer.find(CALL_OPEN)
            if start < 0:
                keep = 0 if final else _partial_prefix(self._buffer, CALL_OPEN)
                out_text.append(self._buffer[: len(self._buffer) - keep])
                self._buffer = self._buffer[len(self._buffer) - keep :]
                break
            out_text.append(self._buffer[:start])
            end = self._buffer.find(CALL_CLOSE, start)
            if end < 0 and not final:
                self._buffer = self._buffer[start:]
                break
            stop = len(self._buffer) if end < 0 else end + len(CALL_CLOSE)
            whole = self._buffer[start:stop]
            call = _parse_block(whole[len(CALL_OPEN) :].removesuffix(CALL_CLOSE).strip(), self._names)
            if call is None:
                out_text.append(whole)
            else:
                calls.append(call.with_id())
                self.num_calls += 1
            self._buffer = self._buffer[stop:].lstrip("\n") if call is not None else self._buffer[stop:]
        return "".join(out_text), calls


def _partial_prefix(text: str, marker: str) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0
