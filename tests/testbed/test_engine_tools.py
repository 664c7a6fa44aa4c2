"""Which tool the simulated model calls, and with what: the tool whose name and description
fit the user's last message, its arguments taken from that message; no call when none fits;
``tool_choice`` honoured."""
from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from sparkfleet.testbed.engine import text
from sparkfleet.testbed.engine.local import SimServer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
STOCK = {"type": "function", "function": {
    "name": "get_stock_price", "description": "Latest trading price of a stock, by ticker symbol.",
    "parameters": {"type": "object", "required": ["ticker"], "properties": {"ticker": {"type": "string"}}}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web and return matching pages.",
    "parameters": {"type": "object", "required": ["query", "max_results"], "properties": {
        "query": {"type": "string"}, "max_results": {"type": "integer"}}}}}
TOOLS = [STOCK, WEATHER, SEARCH]


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    with SimServer(env={"SIM_DECODE_TOK_S": "5000", "SIM_TTFT_S": "0.001"}) as srv:
        yield openai.OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0)


def ask(client: openai.OpenAI, question: str, tools: list[Any], **kwargs: Any) -> Any:
    return client.chat.completions.create(model="qwen", messages=[{"role": "user", "content": question}],
                                          tools=tools, max_tokens=300, **kwargs).choices[0]


def called(choice: Any) -> tuple[str, dict[str, Any]]:
    (call,) = choice.message.tool_calls
    return call.function.name, json.loads(call.function.arguments)


def test_the_city_asked_about_is_the_argument(client: openai.OpenAI) -> None:
    choice = ask(client, "What's the weather in Tokyo?", [WEATHER])
    assert choice.finish_reason == "tool_calls"
    assert called(choice) == ("get_weather", {"city": "Tokyo"})


@pytest.mark.parametrize(("question", "name", "arguments"), [
    ("What's the weather in Tokyo?", "get_weather", {"city": "Tokyo"}),
    ("Will it rain in New York City over the next 3 days? Answer in fahrenheit.", "get_weather",
     {"city": "New York City", "days": 3, "unit": "fahrenheit"}),
    ("What is the stock price of NVDA today?", "get_stock_price", {"ticker": "NVDA"}),
    ('Search the web for "dgx spark vllm", 5 results.', "search_web", {"query": "dgx spark vllm", "max_results": 5}),
])
def test_the_matching_tool_is_chosen_among_several(client: openai.OpenAI, question: str, name: str,
                                                   arguments: dict[str, Any]) -> None:
    assert called(ask(client, question, TOOLS)) == (name, arguments)


@pytest.mark.parametrize("question", ["What is the capital of France?", "Write a short poem about the sea."])
def test_no_tool_is_called_when_none_matches(client: openai.OpenAI, question: str) -> None:
    choice = ask(client, question, TOOLS)
    assert not choice.message.tool_calls and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_tool_choice_is_honoured(client: openai.OpenAI) -> None:
    # "required": a call even when nothing fits, of the tool that fits best
    assert called(ask(client, "Write a short poem about the sea.", TOOLS, tool_choice="required"))[0] in (
        "get_stock_price", "get_weather", "search_web")
    choice = ask(client, "How warm is Lisbon? Check the weather.", TOOLS, tool_choice="required")
    assert choice.finish_reason == "tool_calls" and called(choice) == ("get_weather", {"city": "Lisbon"})
    # a named tool is called whatever fits better, with the arguments the message gives it
    choice = ask(client, "What's the weather in Tokyo?", TOOLS,
                 tool_choice={"type": "function", "function": {"name": "search_web"}})
    assert called(choice)[0] == "search_web" and choice.finish_reason == "stop"
    # "none": never a call, even when asked for one
    choice = ask(client, "What's the weather in Tokyo? Use get_weather.", TOOLS, tool_choice="none")
    assert not choice.message.tool_calls


def test_a_tool_named_in_the_message_wins() -> None:
    last = {"role": "user"}
    assert text.pick_tool(TOOLS, "auto", last, "Use search_web to find the weather in Oslo")["name"] == "search_web"
    assert text.pick_tool(TOOLS, "auto", last, "Use the tool, please.") is None  # which one? none fits
    assert text.pick_tool([WEATHER], "auto", last, "Use the tool, please.")["name"] == "get_weather"
    assert text.pick_tool(TOOLS, "auto", {"role": "tool"}, "What's the weather in Tokyo?") is None


def test_optional_parameters_only_when_the_message_gives_them() -> None:
    function = WEATHER["function"]
    assert text.arguments_from(function, "weather in Rome") == {"city": "Rome"}
    assert text.arguments_from(function, "weather in rome for 2 days in celsius") == {
        "city": "rome", "days": 2, "unit": "celsius"}
