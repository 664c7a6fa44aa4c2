"""The synthetic checkpoints' chat template, and the same rendering in Python.

``CHAT_TEMPLATE`` is what ``tokenizer_config.json`` (and ``chat_template.jinja``) carry:
Qwen3.5's shape, cut down: a system turn that lists the tools as JSON and asks for calls in
Qwen3's XML form, ``<|im_start|>role ... <|im_end|>`` turns, assistant tool calls written
back as XML, tool results grouped into one user turn of ``<tool_response>`` blocks, and a
generation prompt that opens ``<think>`` (closed at once when ``enable_thinking`` is false).

``render`` produces the same text without Jinja (the serving image has none), so the
engine's ``usage.prompt_tokens`` is the length of what ``apply_chat_template`` gives a
client; tests/testbed/test_tokenizer.py renders both and compares. Like vLLM, ``render``
reads a tool call's ``arguments`` given as a JSON string as the object it spells, and joins
a list of content parts with newlines; a template given a string ``arguments`` writes none.
"""
from __future__ import annotations

import json
from typing import Any

TOOLS_INTRO = "# Tools\n\nYou have access to the following functions:\n\n<tools>"
TOOLS_OUTRO = ("\n</tools>\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:"
               "\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
               "</parameter>\n</function>\n</tool_call>")

CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(TOOLS_INTRO) + " }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- " + repr(TOOLS_OUTRO + "<|im_end|>\n") + " }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' + content }}"
    "{%- for tool_call in message.tool_calls or [] %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{%- if content or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{%- if tool_call.arguments is mapping %}"
    "{%- for name, value in tool_call.arguments | items %}"
    "{{- '<parameter=' + name + '>\\n' }}"
    "{%- if value is mapping or (value is sequence and value is not string) %}{{- value | tojson }}"
    "{%- else %}{{- value | string }}{%- endif %}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
    "{%- endif %}"
)


def content_text(content: Any) -> str:
    """A message's content as the template sees it (vLLM joins text parts with newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and "text" in p)
    return ""


def _arguments(raw: Any) -> dict[str, Any] | None:
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError:
            return None
    return raw if isinstance(raw, dict) else None


def _value(value: Any) -> str:
    if isinstance(value, dict | list | tuple):
        return json.dumps(value, ensure_ascii=False)
    return str(value)


def render(messages: list[dict[str, Any]], tools: list[Any] | None = None, add_generation_prompt: bool = True,
           enable_thinking: bool = True) -> str:
    """What ``CHAT_TEMPLATE`` renders for these messages and tools."""
    out: list[str] = []
    first = messages[0] if messages else {}
    has_system = first.get("role") == "system"
    if tools:
        out.append("<|im_start|>system\n")
        if has_system:
            out.append(content_text(first.get("content")) + "\n\n")
        out.append(TOOLS_INTRO)
        out += ["\n" + json.dumps(tool, ensure_ascii=False) for tool in tools]
        out.append(TOOLS_OUTRO + "<|im_end|>\n")
    elif has_system:
        out.append(f"<|im_start|>system\n{content_text(first.get('content'))}<|im_end|>\n")
    for i, message in enumerate(messages):
        role = message.get("role")
        content = content_text(message.get("content"))
        if role == "system" and i == 0:
            continue
        if role in ("user", "system"):
            out.append(f"<|im_start|>{role}\n{content}<|im_end|>\n")
        elif role == "assistant":
            out.append("<|im_start|>assistant\n" + content)
            for j, call in enumerate(message.get("tool_calls") or []):
                function = call.get("function", call) if isinstance(call, dict) else {}
                if content or j:
                    out.append("\n")
                out.append(f"<tool_call>\n<function={function.get('name', '')}>\n")
                for name, value in (_arguments(function.get("arguments")) or {}).items():
                    out.append(f"<parameter={name}>\n{_value(value)}\n</parameter>\n")
                out.append("</function>\n</tool_call>")
            out.append("<|im_end|>\n")
        elif role == "tool":
            if i == 0 or messages[i - 1].get("role") != "tool":
                out.append("<|im_start|>user")
            out.append(f"\n<tool_response>\n{content}\n</tool_response>")
            if i == len(messages) - 1 or messages[i + 1].get("role") != "tool":
                out.append("<|im_end|>\n")
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n" + ("<think>\n" if enable_thinking else "<think>\n\n</think>\n\n"))
    return "".join(out)
