"""The simulated checkpoints' tokenizer: a small byte-level BPE in Qwen's own format.

``build(vocab_size)`` trains it, deterministically, on ``corpus()`` (English prose, the
simulated model's own output, chat and tool-call markup) and returns the ``tokenizer.json``
document that every synthetic repo carries (checkpoints.py writes it, with the chat
template of template.py in ``tokenizer_config.json``). The pipeline is Qwen2/Qwen3's: NFC,
the split regex of ``Qwen2Tokenizer``, byte-level, BPE over 256 byte tokens, and the
special tokens (``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``<tool_call>`` ...) at the
ids the synthetic ``config.json`` names (``<|im_end|>`` is ``eos_token_id``). So
``tokenizers.Tokenizer.from_file`` and ``transformers.AutoTokenizer.from_pretrained``
load a snapshot offline, as a benchmark client does.

``Tokenizer`` reads that document back and encodes as the ``tokenizers`` library does
(tests/testbed/test_tokenizer.py holds them to the same ids): the serving image has no
``tokenizers``, and the engine counts ``usage.prompt_tokens`` with this one. Python's
``re`` has no ``\\p{L}``/``\\p{N}``, so ``PY_PATTERN`` spells Qwen's regex with the classes
Python has (a letter is a word character that is neither a digit, ``_`` nor a number of
category Nl/No); both read Unicode as their own tables say, which differ only on
characters newer than the older of the two.
"""
from __future__ import annotations

import functools
import json
import re
import unicodedata
from collections import Counter
from pathlib import Path
from typing import Any

from . import lexicon, template

#: Qwen2/Qwen3's split regex (transformers' ``Qwen2Tokenizer.PRETOKENIZE_REGEX``), as
#: ``tokenizer.json`` carries it for the Rust library (Oniguruma syntax).
QWEN_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")

#: Unicode White_Space (Oniguruma's ``\s``; Python's also takes U+001C..U+001F).
_SPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"


def _other_numbers() -> str:
    """Code points of category Nl or No, as a character-class body (none lie above U+1FFFF)."""
    ranges: list[list[int]] = []
    for cp in range(0x20000):
        if unicodedata.category(chr(cp)) in ("Nl", "No"):
            if ranges and ranges[-1][1] == cp - 1:
                ranges[-1][1] = cp
            else:
                ranges.append([cp, cp])
    return "".join(re.escape(chr(a)) if a == b else f"{re.escape(chr(a))}-{re.escape(chr(b))}" for a, b in ranges)


@functools.cache
def py_pattern() -> re.Pattern[str]:
    """``QWEN_PATTERN`` for Python's ``re``: \\p{L} = [^\\W\\d_NlNo], \\p{N} = [\\dNlNo],
    [^..\\p{L}\\p{N}] = a non-word character or ``_``."""
    nl_no = _other_numbers()
    letter = rf"[^\W\d_{nl_no}]"
    number = rf"[\d{nl_no}]"
    return re.compile(
        rf"(?i:'s|'t|'re|'ve|'m|'ll|'d)|(?:[^\r\n\w]|_)?{letter}+|{number}| ?(?:[^{_SPACE}\w]|_)+[\r\n]*|"
        rf"[{_SPACE}]*[\r\n]+|[{_SPACE}]+(?![^{_SPACE}])|[{_SPACE}]+")


@functools.cache
def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: byte b is shown as this printable character."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def byte_level(piece: str) -> str:
    table = byte_chars()
    return "".join(table[b] for b in piece.encode())


#: Added tokens from the top of the vocabulary down, in Qwen's names; (content, special).
#: The last six sit where the synthetic config.json puts eos (<|im_end|>, vocab-6), the
#: DFlash mask (vocab-5) and the vision tokens (vocab-4 .. vocab-1).
ADDED = (
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<think>", False), ("</think>", False),
    ("<tool_call>", False), ("</tool_call>", False), ("<tool_response>", False), ("</tool_response>", False),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|im_end|>", True), ("<|MASK|>", True),
    ("<|image_pad|>", True), ("<|video_pad|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
)
EOS = "<|im_end|>"
PAD = "<|endoftext|>"


def corpus() -> str:
    """What the tokenizer is trained on: fixed text, so the merges never change."""

    tool = {"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
    chat = template.render(
        [{"role": "system", "content": "You are a helpful assistant."},
         {"role": "user", "content": "What is the weather in Paris right now? Use the get_weather tool."},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
         {"role": "tool", "content": json.dumps({"city": "Paris", "temperature_c": 18, "conditions": "sunny"})}],
        [tool])
    return "\n".join([
        _ENGLISH,
        " ".join(lexicon.WORDS), " ".join(w.capitalize() for w in lexicon.WORDS),
        "".join(lexicon.CODE) * 2, "".join(lexicon.REASONING) * 2,
        chat,
    ])


_ENGLISH = """\
What is the capital of France? The capital of France is Paris. Count from 1 to 100.
Write a short story about a robot who learns to paint. Explain how a transformer model works,
step by step, and give an example. Summarize the following article in three sentences.
Please write a Python function that returns the sum of a list of numbers, with tests.
The quick brown fox jumps over the lazy dog. I would like to know what the weather will be
like tomorrow in Tokyo, London, New York, Berlin and San Francisco. Can you help me plan a trip?
It's a question that people have asked for years: what makes a good answer? You're right, and
we'll see. They've been working on this for a long time, and I'm sure they'd agree.
Here is the data you asked for, as JSON. Return only valid JSON with the fields name, age and city.
The system serves a large language model on a small cluster of machines. Each request has a prompt
and a number of tokens to generate; the server streams them back as they are produced.
Translate this sentence into German. Give me a list of ten ideas for a birthday party.
What time is it in Sydney? Search the web for the latest news about electric cars.
Book a table for two people at an Italian restaurant at seven o'clock this evening.
Send an email to my team about the meeting on Monday. Calculate the total price with tax.
The results show that the new method is faster and uses less memory than the old one.
"""


def train(text: str, size: int) -> list[tuple[str, str]]:
    """BPE merges learned from ``text`` until there are ``size`` tokens (256 bytes included).
    Ties go to the smallest pair, so the same text always gives the same merges."""
    words = Counter(byte_level(p) for p in py_pattern().findall(unicodedata.normalize("NFC", text)))
    splits = {w: list(w) for w in words}
    known = set(byte_chars())
    merges: list[tuple[str, str]] = []
    while len(known) < size:
        pairs: Counter[tuple[str, str]] = Counter()
        for w, n in words.items():
            s = splits[w]
            for pair in zip(s, s[1:]):
                pairs[pair] += n
        if not pairs:
            raise ValueError(f"the corpus gives only {len(known)} tokens, {size} were asked")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merged = best[0] + best[1]
        merges.append(best)
        known.add(merged)
        for s in splits.values():
            i = 0
            while i < len(s) - 1:
                if s[i] == best[0] and s[i + 1] == best[1]:
                    s[i:i + 2] = [merged]
                i += 1
    return merges


@functools.cache
def build(vocab_size: int = 1024) -> dict[str, Any]:
    """The ``tokenizer.json`` document: ``vocab_size`` ids, the added tokens at the top."""
    first_added = vocab_size - len(ADDED)
    plain = corpus()
    for content, _ in ADDED:  # markup is learnt as added tokens, never as merges
        plain = plain.replace(content, "\n")
    merges = train(plain, first_added)
    vocab = {c: i for i, c in enumerate(byte_chars())}
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    added = [{"id": first_added + i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": special} for i, (c, special) in enumerate(ADDED)]
    byte = {"add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_PATTERN}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", **byte}]},
        "post_processor": {"type": "ByteLevel", **byte},
        "decoder": {"type": "ByteLevel", **byte},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [f"{a} {b}" for a, b in merges]},
    }


class Tokenizer:
    """A ``tokenizer.json`` of the shape ``build`` writes, encoded as the Rust library does."""

    def __init__(self, doc: dict[str, Any]) -> None:
        model = doc.get("model") or {}
        if model.get("type") != "BPE" or json.dumps(doc.get("pre_tokenizer")).find(json.dumps(QWEN_PATTERN)) < 0:
            raise ValueError("not a Qwen-style byte-level BPE tokenizer.json")
        self.vocab: dict[str, int] = dict(model["vocab"])
        merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]
        self.ranks = {pair: i for i, pair in enumerate(merges)}
        self.added = {t["content"]: t["id"] for t in doc.get("added_tokens") or []}
        self.ids = {i: t for t, i in self.vocab.items()} | {i: t for t, i in self.added.items()}
        longest_first = sorted(self.added, key=len, reverse=True)
        self._added_re = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        self._bytes = {c: b for b, c in enumerate(byte_chars())}
        self._cache: dict[str, list[int]] = {}

    @classmethod
    def from_file(cls, path: Path | str) -> Tokenizer:
        return cls(json.loads(Path(path).read_text()))

    def __len__(self) -> int:
        return len(self.ids)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for m in self._added_re.finditer(text) if self._added_re else ():
            ids += self._encode_plain(text[pos:m.start()])
            ids.append(self.added[m.group()])
            pos = m.end()
        return ids + self._encode_plain(text[pos:])

    def count(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: list[int]) -> str:
        out: list[str] = []
        raw = bytearray()
        for i in ids:
            token = self.ids[i]
            if i in self.added.values():
                out.append(raw.decode(errors="replace"))
                raw.clear()
                out.append(token)
            else:
                raw += bytes(self._bytes[c] for c in token)
        return "".join(out) + raw.decode(errors="replace")

    def _encode_plain(self, text: str) -> list[int]:
        ids: list[int] = []
        for piece in py_pattern().findall(unicodedata.normalize("NFC", text)):
            cached = self._cache.get(piece)
            if cached is None:
                if len(self._cache) >= 1 << 16:
                    self._cache.clear()
                cached = self._cache[piece] = self._bpe(byte_level(piece))
            ids += cached
        return ids

    def _bpe(self, word: str) -> list[int]:
        """Merge the lowest-ranked adjacent pair (the leftmost of equals) until none is known."""
        parts = list(word)
        while len(parts) > 1:
            best: tuple[int, int] | None = None
            for i, pair in enumerate(zip(parts, parts[1:])):
                rank = self.ranks.get(pair)
                if rank is not None and (best is None or rank < best[0]):
                    best = (rank, i)
            if best is None:
                break
            i = best[1]
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return [self.vocab[p] for p in parts]


@functools.cache
def default() -> Tokenizer:
    """The synthetic checkpoints' tokenizer, for an engine that serves no snapshot of its own."""
    return Tokenizer(build())


def for_snapshot(snapshot: Path | None) -> Tokenizer:
    """The tokenizer a snapshot ships, or the synthetic one where it ships none this engine reads."""
    path = snapshot / "tokenizer.json" if snapshot is not None else None
    if path is not None and path.is_file():
        try:
            return Tokenizer.from_file(path)
        except (ValueError, KeyError, TypeError):
            pass
    return default()
