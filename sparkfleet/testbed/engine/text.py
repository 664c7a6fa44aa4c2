"""The simulated model: what it writes, token by token, in Qwen3's own output format.

Text is deterministic per prompt: "capital of France" -> "Paris."; counting, code, JSON,
arithmetic and prose prompts get matching text; a reply ends by itself (finish "stop")
unless ``ignore_eos``/``min_tokens``/``max_tokens`` say otherwise.

The raw output is what Qwen3.5 writes before any parser sees it: its thinking, ended by
``</think>`` (the chat template opens ``<think>`` in the prompt; thinking is on unless the
request sets ``chat_template_kwargs.enable_thinking: false``, as with Qwen3.5), then
either an answer or a tool call in Qwen3's XML form::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The server's parsers (``parsers.py``) turn that into ``reasoning``, ``content`` and
``tool_calls``, as vLLM's do; without them the raw text is the content.

A tool call comes when ``tool_choice`` names a tool or requires one, or when the last
message is the user's and a declared tool matches it: the tool whose name and description
share the most words with the message (its name counts double; a message that names a
tool, or asks for "a tool" when one is declared, matches too). Its arguments come from the
message: a place after "in"/"for"/"at" for a city or location, a quoted string, the numbers
in order for numeric parameters, an enum value the message says, else the phrase after
"for"/"about" or the message itself; an optional parameter is set only when the message
gives it. ``tool_choice: "none"`` never calls. After a tool result the model answers in
prose, quoting the result.

Prompt lengths are counted as vLLM counts them: the chat template's text
(``template.render``) encoded by the checkpoint's tokenizer (``tokenizer.py``).

The **workload** of a request (what ``perf.py`` sets acceptance by) is what its answer
is: ``counting``, ``code`` or ``prose`` for a completion; for a chat request ``agent``
when tools or tool calls are in play (the agent-turn replay), else ``chat``.
"""
from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Iterator
from typing import Any

from . import perf, template, tokenizer
from .lexicon import CODE, REASONING, WORDS

THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")
_PIECE_RE = re.compile(r"\w+|\s+|[^\w\s]")
_COUNTING_RE = re.compile(r"\bcount|\bnumbers from \d+ to \d+")
_CODE_RE = re.compile(r"\b(code|function|python|program|script|implement|implementation|class)\b")


def count_tokens(text: str, tok: tokenizer.Tokenizer | None = None) -> int:
    """Tokens of ``text`` in the checkpoint's tokenizer (the synthetic one by default)."""
    return (tok or tokenizer.default()).count(text)


def pieces_of(text: str) -> list[str]:
    """``text`` cut into the tokens the simulated model emits (words, spaces, marks)."""
    return _PIECE_RE.findall(text)


def text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def chat_prompt_tokens(messages: list[dict[str, Any]], tools: list[Any], thinking: bool = True,
                       tok: tokenizer.Tokenizer | None = None) -> int:
    """The prompt's length after the chat template, as ``apply_chat_template`` would count it."""
    return count_tokens(template.render(messages, tools or None, enable_thinking=thinking), tok)


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _prose(rng: random.Random) -> Iterator[str]:
    while True:
        length = rng.randint(8, 18)
        for i in range(length):
            word = rng.choice(WORDS)
            yield " " + (word.capitalize() if i == 0 else word)
        yield "."


def _filler(seed_text: str) -> Iterator[str]:
    return _prose(random.Random(_seed("filler:" + seed_text)))


def completion_workload(prompt: str) -> str:
    low = prompt.lower()
    if _COUNTING_RE.search(low):
        return perf.COUNTING
    if _CODE_RE.search(low):
        return perf.CODE
    return perf.PROSE


def chat_workload(messages: list[dict[str, Any]], tools: list[Any]) -> str:
    in_play = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in messages)
    return perf.AGENT if in_play else perf.CHAT


def answer(topic_text: str, seed_text: str, chat: bool) -> list[str]:
    """The natural answer to ``topic_text``, ending where the model would stop."""
    rng = random.Random(_seed(seed_text))
    low = topic_text.lower()
    if "capital of france" in low:
        return ["Paris", "."]
    m = re.search(r"\bnumbers from (\d+) to (\d+)", low) or re.search(r"\bcount\w*(?: from (\d+))? to (\d+)", low)
    if m or re.search(r"\bcount", low):
        start = int(m.group(1) or 1) if m else 1
        top = min(int(m.group(2)), start + 10000) if m else 100
        return [f" {i}" for i in range(start, top + 1)]
    m = re.search(r"(\d+)\s*[*x×]\s*(\d+)", low)
    if m:
        a, b = int(m.group(1)), int(m.group(2))
        return pieces_of(f"{a} × {b} = {a} × {b // 100 * 100} + {a} × {b % 100} = "
                         f"{a * (b // 100 * 100)} + {a * (b % 100)} = {a * b}")
    if "json" in low:
        m = re.search(r"\b(\d+)\b", low)
        items = min(int(m.group(1)), 200) if m else rng.randint(2, 4)
        out = ["["]
        for i in range(items):  # noqa: B007
            out += ["{"]
            for j in range(rng.randint(5, 7)):
                out += ['"', f"field_{j}", '":', ' "', rng.choice(WORDS), " ", rng.choice(WORDS), '"', ","]
            out[-1] = "}"
            out.append(",")
        out[-1] = "]"
        return out
    if _CODE_RE.search(low):
        # "complete" asks for a whole implementation: long enough to fill a 2048 budget.
        repeats = 60 if "complete" in low and chat else rng.randint(6, 10) if chat else rng.randint(2, 4)
        return list(CODE) * repeats
    prose = _prose(rng)
    return [next(prose) for _ in range(rng.randint(120, 220) if chat else rng.randint(40, 120))]


def completion_output(prompt: str) -> tuple[list[str], Iterator[str]]:
    return answer(prompt, prompt, chat=False), _filler(prompt)


_STOPWORDS = frozenset((
    "a an and are as at be by can could do does for from get give how i in is it its me my of on or "
    "please right now s set show tell that the this to use using what whats when where which who will with "
    "would you your current latest value"
).split())
_GENERIC = frozenset(("tool", "tools", "function", "functions", "call"))
_WORD_RE = re.compile(r"[a-z0-9]+")
_PLACE_NAMES = ("city", "location", "place", "town", "country", "destination", "region", "where")
_PLACE_RE = re.compile(r"\b(?i:in|for|at|near|from|to)\s+([A-Z][\w'-]*(?:\s+(?:[A-Z][\w'-]*|de|del|da|do))*)")
_NAME_RE = re.compile(r"[A-Z][\w'-]*(?:\s+[A-Z][\w'-]*)*")
_AFTER_RE = re.compile(r"\b(?:in|for|at|near|about|on|named|called)\s+([^.?!,;]+)", re.IGNORECASE)
_QUOTED_RE = re.compile(r'"([^"]+)"|\u201c([^\u201d]+)\u201d|(?<!\w)\'([^\']+)\'(?!\w)')
_NUMBER_RE = re.compile(r"(?<![\w.])-?\d+(?:\.\d+)?(?![\w.]*\w)")


def _words(text: str) -> set[str]:
    """Content words of ``text``, lower case, a plural's "s" dropped; snake and camel case split."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", text).replace("_", " ").lower().replace("'", "")
    return {w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w
            for w in _WORD_RE.findall(spaced)} - _STOPWORDS


def tool_score(function: dict[str, Any], message: str) -> int:
    """How well ``function`` fits ``message``: shared words, the name's counting double."""
    said = _words(message)
    name = str(function.get("name", ""))
    if name and re.search(rf"\b{re.escape(name.lower())}\b", message.lower()):
        return 100  # the message names the tool
    return 2 * len(_words(name) & said) + len(_words(str(function.get("description", ""))) & said)


def _functions(tools: list[Any]) -> list[dict[str, Any]]:
    return [t["function"] for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)]


def pick_tool(tools: list[Any], tool_choice: Any, last: dict[str, Any], last_user: str) -> dict[str, Any] | None:
    """The function the model calls, or None for an answer in words."""
    functions = _functions(tools)
    if not functions or tool_choice in (None, "none"):
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        return next((f for f in functions if f.get("name") == name), functions[0])
    scores = [tool_score(f, last_user) for f in functions]
    best = max(range(len(functions)), key=lambda i: (scores[i], -i))
    if tool_choice == "required":
        return functions[best]
    if last.get("role") != "user":
        return None  # after a tool result the simulated model answers in prose
    if scores[best] > 0:
        return functions[best]
    asks_for_a_tool = bool(_words(last_user) & _GENERIC)
    return functions[0] if asks_for_a_tool and len(functions) == 1 else None


def _names(message: str) -> Iterator[str]:
    """Capitalised words and acronyms of ``message`` that do not start a sentence."""
    for m in _NAME_RE.finditer(message):
        before = message[:m.start()].rstrip()
        if m.group() != "I" and before and before[-1] not in ".?!":
            yield m.group()


def _string_value(name: str, message: str, quoted: list[str], wanted: bool) -> str | None:
    """A string parameter's value from the message: a quoted string; for a place, the name
    after "in"/"for"/"at"; a name in the message; else, for a required one, the phrase
    after "for"/"about"/... or the message itself."""
    if quoted:
        return quoted.pop(0)
    place = any(p in name.lower() for p in _PLACE_NAMES)
    m = _PLACE_RE.search(message) if place else None
    if m:
        return m.group(1)
    if not wanted:
        return None
    found = next(_names(message), None)
    if found is not None:
        return found
    m = _AFTER_RE.search(message)
    if place:
        words = [w for w in m.group(1).split() if w.lower() not in _STOPWORDS] if m else []
        return words[0] if words else None
    phrase = m.group(1).strip() if m else message.strip().rstrip("?.!")
    return phrase or None


def arguments_from(function: dict[str, Any], message: str) -> dict[str, Any]:
    """The arguments the model gives ``function`` for ``message``: each required parameter,
    from the message where it says one, else a plausible value; optional ones only when said."""
    params = function.get("parameters") or {}
    props = params.get("properties") or {}
    required = [p for p in params.get("required") or [] if isinstance(p, str)]
    quoted = [next(g for g in m.groups() if g) for m in _QUOTED_RE.finditer(message)]
    numbers = _NUMBER_RE.findall(message)
    low = message.lower()
    args: dict[str, Any] = {}
    for name in [*required, *(p for p in props if p not in required)]:
        schema = props.get(name) if isinstance(props.get(name), dict) else {}
        kind = schema.get("type")
        wanted = name in required
        value: Any = None
        if schema.get("enum"):
            said = [v for v in schema["enum"] if re.search(rf"\b{re.escape(str(v).lower())}\b", low)]
            value = said[0] if said else (schema["enum"][0] if wanted else None)
        elif kind in ("integer", "number"):
            if numbers:
                raw = numbers.pop(0)
                value = float(raw) if kind == "number" and "." in raw else int(float(raw))
            elif wanted:
                value = 1
        elif kind == "boolean":
            value = True if wanted else None
        elif kind == "array":
            value = [] if wanted else None
        elif kind == "object":
            value = {} if wanted else None
        else:
            value = _string_value(name, message, quoted, wanted)
            if value is None and wanted:
                value = "Paris" if any(p in name.lower() for p in _PLACE_NAMES) else f"{name}_value"
        if value is not None:
            args[name] = value
    return args


def tool_call_xml(function: dict[str, Any], message: str = "") -> list[str]:
    """A call of ``function`` with the arguments ``message`` gives it, as Qwen3 writes it."""
    out = [TOOL_CALL_START, "\n", f"<function={function.get('name', 'tool')}>", "\n"]
    for name, value in arguments_from(function, message).items():
        raw = value if isinstance(value, str) else json.dumps(value)
        out += [f"<parameter={name}>", "\n", *pieces_of(raw), "\n", "</parameter>", "\n"]
    return out + ["</function>", "\n", TOOL_CALL_END]


def chat_output(messages: list[dict[str, Any]], tools: list[Any], tool_choice: Any,
                thinking: bool) -> tuple[list[str], Iterator[str], bool]:
    """(raw output tokens, filler past EOS, whether the output is a tool call)."""
    last_user = next((text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    seed_text = json.dumps(messages, sort_keys=True, default=str)
    function = pick_tool(tools, tool_choice, messages[-1], last_user)
    if function is not None:
        body = tool_call_xml(function, last_user)
    elif messages[-1].get("role") == "tool":
        result = pieces_of(text_of(messages[-1].get("content")))[:40]
        body = pieces_of("Here is what the tool returned: ") + result + ["."]
    else:
        body = answer(last_user, seed_text, chat=True)
    # Qwen3.5's chat template puts <think> in the prompt: the output starts inside it.
    think = [*REASONING, THINK_END] if thinking else []
    return think + body, _filler(seed_text), function is not None
