"""The synthetic checkpoints' tokenizer and chat template, read as a benchmark client reads
them (``tokenizers``, ``transformers``, Jinja), and the engine's prompt counts against them."""
from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sparkfleet.testbed import checkpoints as ck
from sparkfleet.testbed.engine import template
from sparkfleet.testbed.engine import tokenizer as tk
from sparkfleet.testbed.engine.local import SimServer

SENTENCE = "What's the weather in Tokyo? It should be sunny, 18 °C."
TEXTS = [
    SENTENCE,
    "Hello, world! It's   fine.\n\n  indented\tand\r\nCRLF  \n",
    "naïve café ½ ² Ⅻ 12345 _foo__bar (parens) [x] {y: 'z'} don't THEY'LL",
    "日本語のテキスト 한국어 Ελληνικά emoji 🎉🎉",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n",
    "def process_items(items):\n    total = 0\n    for item in items:\n        total += item\n",
]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string", "description": "the city's name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
CONVERSATIONS: list[tuple[list[dict[str, Any]], list[Any] | None]] = [
    ([{"role": "user", "content": "What is the capital of France?"}], None),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Count to 3."}], None),
    ([{"role": "user", "content": "What's the weather in Tokyo?"}], [WEATHER]),
    ([{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris and Rome?"},
      {"role": "assistant", "content": None, "tool_calls": [
          {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
          {"id": "b", "type": "function", "function": {"name": "get_weather",
                                                       "arguments": {"city": "Rome", "days": 2, "flags": [1, "é"]}}}]},
      {"role": "tool", "tool_call_id": "a", "content": '{"temperature_c": 18}'},
      {"role": "tool", "tool_call_id": "b", "content": '{"temperature_c": 24}'}], [WEATHER]),
]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What a synthetic repo carries beside its weights, with its config.json."""
    d = tmp_path_factory.mktemp("snapshot")
    ck.common_files(d, ck.D)
    ck.write_json(d / "config.json", ck.model_config(ck.D))
    return d


def jinja_render(messages: list[dict[str, Any]], tools: list[Any] | None, **kwargs: Any) -> str:
    """CHAT_TEMPLATE rendered as transformers renders a chat template (its tojson, its flags)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False)
    return env.from_string(template.CHAT_TEMPLATE).render(messages=messages, tools=tools, **kwargs)


def test_the_repo_tokenizer_is_a_real_bpe_that_tokenizers_loads(snapshot: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    tok = tokenizers.Tokenizer.from_file(str(snapshot / "tokenizer.json"))
    config = json.loads((snapshot / "config.json").read_text())
    assert tok.get_vocab_size() == config["text_config"]["vocab_size"] == ck.D.vocab
    ids = tok.encode(SENTENCE).ids
    assert 5 < len(ids) < len(SENTENCE)  # words and pieces of words, not one token, not bytes
    assert tok.decode(ids) == SENTENCE
    eos = json.loads((snapshot / "generation_config.json").read_text())["eos_token_id"]
    assert eos == [tok.token_to_id("<|im_end|>")]
    assert config["vision_start_token_id"] == tok.token_to_id("<|vision_start|>")
    assert tok.encode("<|im_start|>user").ids[0] == tok.token_to_id("<|im_start|>")


@pytest.mark.parametrize("text", TEXTS)
def test_the_engines_reader_encodes_as_tokenizers_does(snapshot: Path, text: str) -> None:
    mine = tk.Tokenizer.from_file(snapshot / "tokenizer.json")
    ids = mine.encode(text)
    assert mine.decode(ids) == text
    assert len(ids) > 1
    tokenizers = pytest.importorskip("tokenizers")
    assert ids == tokenizers.Tokenizer.from_file(str(snapshot / "tokenizer.json")).encode(text).ids


def test_the_tokenizer_is_built_the_same_every_time() -> None:
    assert tk.build.__wrapped__(ck.D.vocab) == tk.build(ck.D.vocab)


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS)
@pytest.mark.parametrize("thinking", [True, False])
def test_render_is_what_the_chat_template_renders(messages: list[dict[str, Any]], tools: list[Any] | None,
                                                  thinking: bool) -> None:
    expected = jinja_render(messages, tools, add_generation_prompt=True, enable_thinking=thinking)
    assert template.render(messages, tools, enable_thinking=thinking) == expected
    assert expected.endswith("<think>\n" if thinking else "</think>\n\n")


def test_auto_tokenizer_loads_the_snapshot_offline_and_applies_its_template(
        snapshot: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    transformers = pytest.importorskip("transformers")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    auto = transformers.AutoTokenizer.from_pretrained(str(snapshot))
    mine = tk.Tokenizer.from_file(snapshot / "tokenizer.json")
    assert auto.encode(SENTENCE) == mine.encode(SENTENCE) and auto.decode(auto.encode(SENTENCE)) == SENTENCE
    assert auto.eos_token == "<|im_end|>"
    for messages, tools in CONVERSATIONS:
        rendered = auto.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert rendered == template.render(messages, tools)
        ids = auto.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
        assert list(ids) == mine.encode(rendered)


@pytest.fixture(scope="module")
def server() -> Iterator[SimServer]:
    with SimServer(env={"SIM_DECODE_TOK_S": "5000", "SIM_TTFT_S": "0.001"}) as srv:
        yield srv


def post(srv: SimServer, path: str, body: dict[str, Any]) -> dict[str, Any]:
    resp = requests.post(srv.base_url + path, json={"model": "qwen", "max_tokens": 4, **body}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.parametrize(("messages", "tools"), CONVERSATIONS)
def test_usage_prompt_tokens_is_the_tokenizers_count(server: SimServer, snapshot: Path,
                                                     messages: list[dict[str, Any]], tools: list[Any] | None) -> None:
    mine = tk.Tokenizer.from_file(snapshot / "tokenizer.json")
    # The client sends arguments as OpenAI does, a JSON string; vLLM reads it back before templating.
    wire = [{**m, "tool_calls": [{**c, "function": {**c["function"], "arguments": json.dumps(c["function"]["arguments"])}}
                                 for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]
    for thinking in (True, False):
        body: dict[str, Any] = {"messages": wire, "chat_template_kwargs": {"enable_thinking": thinking}}
        if tools:
            body["tools"] = tools
        usage = post(server, "/v1/chat/completions", body)["usage"]
        assert usage["prompt_tokens"] == len(mine.encode(jinja_render(
            messages, tools, add_generation_prompt=True, enable_thinking=thinking)))


def test_completion_prompt_tokens_is_the_tokenizers_count(server: SimServer, snapshot: Path) -> None:
    mine = tk.Tokenizer.from_file(snapshot / "tokenizer.json")
    for text in TEXTS:
        assert post(server, "/v1/completions", {"prompt": text})["usage"]["prompt_tokens"] == len(mine.encode(text))


def test_an_engine_reads_the_tokenizer_its_snapshot_ships(snapshot: Path, tmp_path: Path) -> None:
    assert tk.for_snapshot(snapshot).encode(SENTENCE) == tk.default().encode(SENTENCE)
    doc = json.loads((snapshot / "tokenizer.json").read_text())
    doc["model"]["merges"] = doc["model"]["merges"][:10]  # another tokenizer: fewer merges, more tokens
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc))
    assert tk.for_snapshot(tmp_path).count(SENTENCE) > tk.default().count(SENTENCE)
    assert tk.for_snapshot(tmp_path / "nowhere") is tk.default()
