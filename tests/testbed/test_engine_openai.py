"""Tool calls and reasoning on the simulated engine, read with the real ``openai`` client,
the way vLLM 0.23 serves them with ``--tool-call-parser qwen3_xml --reasoning-parser qwen3``
(vllm/tool_parsers/qwen3xml_tool_parser.py, vllm/reasoning/qwen3_reasoning_parser.py,
vllm/entrypoints/openai/chat_completion/serving.py): ``tool_calls`` with a JSON-string
``arguments``, ``finish_reason: "tool_calls"``, streamed as tool-call deltas; thinking in
``reasoning``; without a parser none of that."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from sparkfleet.bench.onhost.checks import tool_call_round_trip
from sparkfleet.bench.onhost.client import Client
from sparkfleet.testbed.engine.local import SimServer

FAST = {"SIM_DECODE_TOK_S": "2000", "SIM_TTFT_S": "0.005"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "required": ["city", "days", "metric"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}}}}}
ASK = [{"role": "user", "content": "Use get_weather for Paris please."}]
WANTED = {"city": "Paris", "days": 1, "metric": True}


@pytest.fixture(scope="module")
def server() -> Iterator[SimServer]:
    with SimServer(env=FAST) as srv:
        yield srv


def client_for(srv: SimServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)


def test_a_tool_call_comes_back_as_vllms_parser_returns_it(server: SimServer) -> None:
    resp = client_for(server).chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=200)
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and len(call.id) > 20
    assert call.function.name == "get_weather"
    assert isinstance(call.function.arguments, str)
    assert json.loads(call.function.arguments) == WANTED  # values typed by the schema
    assert call.function.arguments == json.dumps(WANTED)  # qwen3_xml's spelling: '{"k": v, ...}'
    reasoning = choice.message.model_extra["reasoning"]  # vLLM 0.23's field name
    assert reasoning and "<think>" not in reasoning and "</think>" not in reasoning


def test_a_tool_call_streams_as_tool_call_deltas(server: SimServer) -> None:
    stream = client_for(server).chat.completions.create(
        model="qwen", messages=ASK, tools=[WEATHER], max_tokens=200, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    first = calls[0]
    assert first.index == 0 and first.id.startswith("chatcmpl-tool-") and first.type == "function"
    assert first.function.name == "get_weather"  # the first delta names the function
    # qwen3_xml repeats id and type in every delta, with no name; a block's deltas arrive merged
    assert len(calls) > 2 and all(tc.id == first.id and tc.function.name is None for tc in calls[1:])
    arguments = "".join(tc.function.arguments for tc in calls)
    assert json.loads(arguments) == WANTED
    assert arguments == json.dumps(WANTED)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    assert not any(d.content for d in deltas)  # the XML never leaks into the content
    assert any(d.model_extra.get("reasoning") for d in deltas)  # thinking streamed apart, before the call
    assert chunks[-1].usage.completion_tokens > 0 and chunks[-1].choices == []


def test_the_round_trip_answers_after_the_tool_result(server: SimServer) -> None:
    out = tool_call_round_trip(Client(server.base_url, "qwen"))
    assert out["status"] == "ok" and out["passed"], out
    assert out["arguments"] == {"city": "Paris"} and out["uses_result"]


def test_without_a_tool_call_parser_there_are_no_tool_calls() -> None:
    with SimServer(env=FAST, tool_call_parser=None) as srv:
        api = client_for(srv)
        with pytest.raises(openai.BadRequestError, match="--enable-auto-tool-choice and --tool-call-parser"):
            api.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER])
        with pytest.raises(openai.BadRequestError, match='tool_choice="required" requires --tool-call-parser'):
            api.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="required")
        plain = api.chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], tool_choice="none")
        assert plain.choices[0].message.tool_calls in (None, []) and plain.choices[0].finish_reason == "stop"
        check = tool_call_round_trip(Client(srv.base_url, "qwen"))
    assert check["status"] == "failed" and "no tool-call parser" in check["reason"]
    assert "tool_call_parser" in check["reason"]


def test_a_parser_that_cannot_read_qwens_format_leaves_the_call_in_the_content() -> None:
    with SimServer(env=FAST, tool_call_parser="hermes") as srv:
        resp = client_for(srv).chat.completions.create(model="qwen", messages=ASK, tools=[WEATHER], max_tokens=200)
        check = tool_call_round_trip(Client(srv.base_url, "qwen"))
    assert not resp.choices[0].message.tool_calls and resp.choices[0].finish_reason == "stop"
    assert "<function=get_weather>" in resp.choices[0].message.content
    assert check["status"] == "failed" and "did not parse" in check["reason"]


def test_reasoning_needs_the_reasoning_parser() -> None:
    ask: Any = [{"role": "user", "content": "What is the capital of France?"}]
    with SimServer(env=FAST, reasoning_parser=None) as srv:
        raw = client_for(srv).chat.completions.create(model="qwen", messages=ask, max_tokens=100)
    message = raw.choices[0].message
    assert message.model_extra.get("reasoning") is None and message.content.endswith("</think>Paris.")
    with SimServer(env=FAST) as srv:
        api = client_for(srv)
        parsed = api.chat.completions.create(model="qwen", messages=ask, max_tokens=100).choices[0].message
        off = api.chat.completions.create(model="qwen", messages=ask, max_tokens=100,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        truncated = api.chat.completions.create(model="qwen", messages=ask, max_tokens=5).choices[0].message
    assert parsed.content == "Paris." and parsed.model_extra["reasoning"].startswith(" Okay")
    assert off.choices[0].message.content == "Paris." and off.choices[0].message.model_extra["reasoning"] is None
    # thinking cut by max_tokens before </think>: all reasoning, no content (qwen3's parser)
    assert truncated.content is None and truncated.model_extra["reasoning"]


def test_a_named_tool_choice_finishes_with_stop() -> None:
    with SimServer(env=FAST) as srv:
        resp = client_for(srv).chat.completions.create(
            model="qwen", messages=[{"role": "user", "content": "hello"}], tools=[WEATHER], max_tokens=200,
            tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert resp.choices[0].finish_reason == "stop"  # vLLM: "tool_calls" only for auto and required
    assert resp.choices[0].message.tool_calls[0].function.name == "get_weather"
