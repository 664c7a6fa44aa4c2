"""A minimal OpenAI/vLLM HTTP client for timing, on the standard library's http.client.

Why not ``requests``: its streaming reads go through fixed-size chunks, and on a
response that is not chunk-encoded ``iter_lines()`` waits for 512 bytes before yielding a
line — timestamps would measure the buffer, not the server. ``http.client`` returns each
SSE line as soon as it arrives (chunked or not), and it ignores proxy variables, which
must never sit between a bench and the server on the same host.

One connection per request, like the reference recipe's harnesses: albond's end-to-end time includes
it, and a fresh connection cannot carry state from the previous run.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from .timing import StreamRecord


class BenchError(RuntimeError):
    """A request failed; the message says what to look at."""


class Client:
    """Talks to one OpenAI-compatible server (vLLM or the simulated engine)."""

    def __init__(
        self, base_url: str, model: str, api_key: str | None = None, timeout: float = 600.0
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise BenchError(f"base URL {base_url!r} is not http(s)://host:port")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key or None
        self.timeout = timeout
        self._scheme = parts.scheme
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._prefix = parts.path.rstrip("/")

    # --- plumbing -------------------------------------------------------------------

    def _connection(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        return cls(self._host, self._port, timeout=self.timeout)

    def _headers(self, body: bool) -> dict:
        headers = {"Accept": "application/json, text/event-stream"}
        if body:
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _open(self, method: str, path: str, body: dict | None) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
        conn = self._connection()
        payload = json.dumps(body).encode() if body is not None else None
        try:
            conn.request(method, self._prefix + path, body=payload, headers=self._headers(payload is not None))
            resp = conn.getresponse()
        except ConnectionRefusedError:
            conn.close()
            raise BenchError(
                f"cannot reach {self.base_url}: connection refused "
                "(is the sparkfleet-serve container running and READY?)"
            ) from None
        except TimeoutError:
            conn.close()
            raise BenchError(f"{method} {path} timed out after {self.timeout:.0f} s") from None
        except OSError as exc:
            conn.close()
            raise BenchError(f"cannot reach {self.base_url}: {exc}") from None
        if resp.status != 200:
            detail = resp.read(600).decode("utf-8", "replace").strip()
            conn.close()
            hint = ""
            if resp.status == 401:
                hint = " (API key rejected: the bench reads VLLM_API_KEY from /etc/sparkfleet/secrets.env)"
            elif resp.status == 404:
                hint = f" (is the served model name {self.model!r}?)"
            raise BenchError(f"{method} {path} -> HTTP {resp.status}{hint}: {detail[:300]}")
        return conn, resp

    def get_json(self, path: str) -> Any:
        conn, resp = self._open("GET", path, None)
        try:
            return json.loads(resp.read())
        finally:
            conn.close()

    def get_text(self, path: str) -> str:
        conn, resp = self._open("GET", path, None)
        try:
            return resp.read().decode("utf-8", "replace")
        finally:
            conn.close()

    def post_json(self, path: str, body: dict) -> tuple[dict, float, float]:
        """POST and read the whole answer; returns (json, t_start, t_end) in perf_counter s."""
        t_start = time.perf_counter()
        conn, resp = self._open("POST", path, body)
        try:
            raw = resp.read()
            t_end = time.perf_counter()
        except TimeoutError:
            raise BenchError(f"POST {path} timed out after {self.timeout:.0f} s") from None
        finally:
            conn.close()
        try:
            return json.loads(raw), t_start, t_end
        except ValueError:
            raise BenchError(f"POST {path}: answer is not JSON: {raw[:200]!r}") from None

    def post_sse(self, path: str, body: dict) -> Iterator[tuple[float, dict]]:
        """POST a streaming request; yield (arrival perf_counter, event) per SSE data line."""
        conn, resp = self._open("POST", path, body)
        try:
            while True:
                try:
                    raw = resp.readline()
                except TimeoutError:
                    raise BenchError(f"stream {path} stalled for {self.timeout:.0f} s") from None
                now = time.perf_counter()
                if not raw:
                    return
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, comments, event: lines
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    event = json.loads(data)
                except ValueError:
                    continue
                if isinstance(event, dict) and "error" in event and not event.get("choices"):
                    raise BenchError(f"stream {path} reported an error: {str(event['error'])[:300]}")
                yield now, event
        finally:
            conn.close()

    # --- what the benches use ----------------------------------------------------------

    def served_models(self) -> list:
        data = self.get_json("/v1/models")
        return [m.get("id") for m in data.get("data", []) if isinstance(m, dict)]

    def metrics_text(self) -> str:
        return self.get_text("/metrics")

    def complete(self, prompt: str, max_tokens: int, **extra: Any) -> tuple[dict, float]:
        """Non-streaming /v1/completions; returns (json, wall seconds)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        body.update(extra)
        data, t0, t1 = self.post_json("/v1/completions", body)
        return data, t1 - t0

    def chat(self, messages: list, max_tokens: int, **extra: Any) -> tuple[dict, float, float]:
        """Non-streaming /v1/chat/completions; returns (json, t_start, t_end)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0}
        body.update(extra)
        return self.post_json("/v1/chat/completions", body)

    def stream_completion(self, prompt: str, max_tokens: int, **extra: Any) -> StreamRecord:
        body = {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        body.update(extra)
        return self._timed_stream("/v1/completions", body)

    def stream_chat(self, messages: list, max_tokens: int, **extra: Any) -> StreamRecord:
        body = {
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True},
        }
        body.update(extra)
        return self._timed_stream("/v1/chat/completions", body)

    def _timed_stream(self, path: str, body: dict) -> StreamRecord:
        t_start = time.perf_counter()
        t_first: float | None = None
        t_last: float | None = None
        kinds: dict = {}
        deltas = 0
        usage: dict | None = None
        for now, event in self.post_sse(path, body):
            if isinstance(event.get("usage"), dict):
                usage = event["usage"]
            found = delta_kinds(event)
            if found:
                deltas += 1
                for kind in found:
                    kinds[kind] = kinds.get(kind, 0) + 1
                if t_first is None:
                    t_first = now
                t_last = now
        t_end = time.perf_counter()
        if usage and usage.get("completion_tokens"):
            tokens, source = int(usage["completion_tokens"]), "usage"
        else:
            # Without usage we can only count deltas, which undercounts when a delta carries
            # several tokens (speculative decoding): flagged in the record.
            tokens, source = deltas, "deltas"
        return StreamRecord(
            t_start=t_start, t_end=t_end, t_first=t_first, t_last=t_last,
            completion_tokens=tokens,
            prompt_tokens=(usage or {}).get("prompt_tokens"),
            deltas=deltas, kinds=kinds, tokens_source=source,
        )


def delta_kinds(event: dict) -> list:
    """Which kinds of generated output an SSE event carries (empty: none).

    Every kind counts as a token arrival: completions ``text``; chat ``content``,
    ``reasoning_content``/``reasoning`` (the qwen3 reasoning parser) and ``tool_calls``
    (the qwen3_xml tool parser). Timing only ``content`` — as the reference recipe's agent bench did —
    would start the clock after the model's thinking and drop tool-call turns.
    """
    kinds = []
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if choice.get("text"):
            kinds.append("text")
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content"):
                kinds.append("content")
            if delta.get("reasoning_content") or delta.get("reasoning"):
                kinds.append("reasoning")
            if delta.get("tool_calls"):
                kinds.append("tool_calls")
    return kinds
