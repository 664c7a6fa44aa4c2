"""vLLM 0.23's output parsers for Qwen3, on the simulated model's raw tokens.

* ``--reasoning-parser qwen3`` (``vllm/reasoning/qwen3_reasoning_parser.py``): the text
  before ``</think>`` is ``reasoning``, the rest ``content``; a leading ``<think>`` is
  dropped; with thinking on and no ``</think>`` yet, everything is reasoning, except
  that ``<tool_call>`` ends reasoning implicitly.
* ``--tool-call-parser qwen3_xml`` (``vllm/tool_parsers/qwen3xml_tool_parser.py``; the
  same format as ``qwen3_coder``): each ``<tool_call><function=NAME><parameter=P>value
  </parameter></function></tool_call>`` becomes a ``tool_calls`` entry with id
  ``chatcmpl-tool-<hex>``, ``type: function`` and the arguments as a JSON string whose
  values are converted by the tool's parameter schema. Streamed, the first delta of a
  call carries id, type, name and ``arguments: ""``; then ``{"P": ``, the value (a string
  value as it arrives, quoted; any other type whole, at ``</parameter>``), ``, "Q": `` ...
  and ``}`` at ``</function>``, each delta repeating id and type with ``name: null``;
  the deltas of one accepted block are merged into one (arguments concatenated), as
  vLLM's ``_merge_new_deltas_to_single_response`` does. Text outside calls stays content.

Another tool parser cannot read Qwen3's XML: the call stays in the content, as it would
with a mismatched parser on a real server.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from .text import THINK_END, THINK_START, TOOL_CALL_END, TOOL_CALL_START

XML_TOOL_PARSERS = frozenset({"qwen3_xml", "qwen3_coder"})
NON_STRING_TYPES = frozenset({"integer", "int", "number", "float", "boolean", "bool", "object", "array"})
_FUNCTION_RE = re.compile(r"^<function=(.+)>$")
_PARAMETER_RE = re.compile(r"^<parameter=(.+)>$")


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def convert(raw: str, schema_type: Any) -> Any:
    """A parameter's text as the type its schema declares (qwen3_xml's conversion)."""
    value = raw.strip("\n")
    kind = schema_type if isinstance(schema_type, str) else "string"
    try:
        if kind in ("integer", "int"):
            return int(value)
        if kind in ("number", "float"):
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
        if kind in ("boolean", "bool"):
            return value.strip().lower() == "true"
        if kind in ("object", "array"):
            return json.loads(value)
    except ValueError:
        return value
    return value


@dataclass
class _Call:
    id: str
    name: str
    params: dict[str, Any] = field(default_factory=dict)
    arguments: str = ""


@dataclass
class OutputParser:
    """The parsers of one request, fed its raw output one accepted block at a time."""
    reasoning: bool  # a reasoning parser is set and thinking is on
    tools: dict[str, dict[str, Any]] | None  # name -> parameter properties; None: no tool parsing
    _in_think: bool = True
    _in_call: bool = False
    _call: _Call | None = None
    _param: str | None = None
    _value: str = ""
    _opened: bool = False  # the current string value's opening quote was sent
    _pending: str = ""  # newlines held back inside a string value
    calls: list[_Call] = field(default_factory=list)
    reasoning_text: str = ""
    content_text: str = ""

    def feed(self, tokens: list[str]) -> dict[str, Any]:
        """The delta these tokens make: ``reasoning``, ``content``, ``tool_calls`` (each optional)."""
        delta: dict[str, Any] = {}
        tool_deltas: list[dict[str, Any]] = []
        for tok in tokens:
            if self.reasoning and self._in_think:
                if tok == THINK_START:
                    continue
                if tok == THINK_END:
                    self._in_think = False
                    continue
                if tok != TOOL_CALL_START:
                    delta["reasoning"] = delta.get("reasoning", "") + tok
                    self.reasoning_text += tok
                    continue
                self._in_think = False  # <tool_call> ends thinking implicitly
            if self.tools is not None and self._tool_token(tok, tool_deltas):
                continue
            delta["content"] = delta.get("content", "") + tok
            self.content_text += tok
        if tool_deltas:
            delta["tool_calls"] = _merge(tool_deltas)
        return delta

    def _tool_token(self, tok: str, out: list[dict[str, Any]]) -> bool:
        """Consume ``tok`` if it belongs to a tool call; append the deltas it makes."""
        if tok == TOOL_CALL_START:
            self._in_call = True
            return True
        if not self._in_call:
            return False
        index = len(self.calls) - 1
        if tok == TOOL_CALL_END:
            self._in_call = False
        elif (m := _FUNCTION_RE.match(tok)) is not None:
            self._call = _Call(id=tool_call_id(), name=m.group(1))
            self.calls.append(self._call)
            out.append({"index": len(self.calls) - 1, "id": self._call.id, "type": "function",
                        "function": {"name": self._call.name, "arguments": ""}})
        elif self._call is None:
            pass  # whitespace between <tool_call> and <function=...>
        elif (m := _PARAMETER_RE.match(tok)) is not None:
            self._param, self._value, self._opened, self._pending = m.group(1), "", False, ""
            self._emit(out, index, ('{' if not self._call.params else ', ') + f'"{self._param}": ')
            self._call.params[self._param] = None
        elif tok == "</parameter>" and self._param is not None:
            value = convert(self._value, self._type(self._param))
            self._call.params[self._param] = value
            if isinstance(value, str):
                self._emit(out, index, '"' if self._opened else '""')
            else:
                self._emit(out, index, json.dumps(value, ensure_ascii=False))
            self._param = None
        elif self._param is not None:
            self._value += tok
            if self._type(self._param) not in NON_STRING_TYPES:
                # A string value streams as it comes; newlines wait for more text (the
                # ones around the value are not part of it).
                if not tok.strip("\n"):
                    self._pending += tok if self._opened else ""
                    return True
                piece = json.dumps(self._pending + tok, ensure_ascii=False)[1:-1]
                self._emit(out, index, ("" if self._opened else '"') + piece)
                self._opened, self._pending = True, ""
        elif tok == "</function>":
            self._emit(out, index, "}" if self._call.params else "{}")
            self._call = None
        return True

    def _type(self, param: str) -> Any:
        assert self._call is not None and self.tools is not None
        return ((self.tools.get(self._call.name) or {}).get(param) or {}).get("type", "string")

    def _emit(self, out: list[dict[str, Any]], index: int, arguments: str) -> None:
        # Like qwen3_xml's, every argument delta repeats the call's id and type (name null).
        call = self.calls[index]
        call.arguments += arguments
        out.append({"index": index, "id": call.id, "type": "function", "function": {"name": None, "arguments": arguments}})

    def message(self) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """(reasoning, content, tool_calls) of the whole output, as the non-streaming answer has them."""
        calls = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                 for c in self.calls]
        content = self.content_text.strip("\n") if calls else self.content_text
        return self.reasoning_text or None, content or None, calls


def _merge(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Deltas of one block, one entry per call (arguments concatenated), like one vLLM chunk."""
    merged: dict[int, dict[str, Any]] = {}
    for d in deltas:
        entry = merged.get(d["index"])
        if entry is None:
            merged[d["index"]] = {**d, "function": dict(d["function"])}
        else:
            entry["function"]["arguments"] += d["function"]["arguments"]
    return list(merged.values())


def tool_properties(tools: list[Any]) -> dict[str, dict[str, Any]]:
    out = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if isinstance(fn, dict) and fn.get("name"):
            out[str(fn["name"])] = ((fn.get("parameters") or {}).get("properties") or {})
    return out
