"""A tiny OpenAI/vLLM-wire-format server with a known truth, for the bench tests.

It emits token i of a response at ``t0 + ttft_s + i / decode_tok_s`` (on an absolute
schedule, so sleeps do not drift), keeps vLLM's speculative-decoding counters as if
each decode step accepted ``accept_len - 1`` draft tokens on average, and records the
request bodies it saw. Stdlib only; 127.0.0.1 only.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import List, Optional


@dataclass
class FakeConfig:
    model: str = "qwen"
    decode_tok_s: float = 200.0
    ttft_s: float = 0.05
    accept_len: Optional[float] = 3.0  # None: no speculative decoder (no spec counters)
    num_spec_tokens: int = 4
    api_key: Optional[str] = None
    tokens_per_chunk: int = 1
    chunked: bool = True  # HTTP/1.1 chunked SSE like uvicorn; False: close-delimited
    usage: bool = True
    natural_tokens: Optional[int] = None  # stop early unless ignore_eos (e2e answers)
    smoke_answer: str = " Paris"
    # Kinds of chat deltas, cycled per token: e.g. ["reasoning"]*3 + ["content"].
    chat_kinds: List[str] = field(default_factory=lambda: ["content"])
    fail_chat_with: Optional[int] = None  # HTTP status for chat requests


class FakeState:
    def __init__(self, cfg: FakeConfig) -> None:
        self.cfg = cfg
        self.lock = threading.Lock()
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.per_pos = [0] * cfg.num_spec_tokens
        self._carry = 0.0
        self.requests: List[dict] = []

    def account(self, tokens: int) -> None:
        """Spec counters for one response: the first token comes from prefill, the rest
        from decode steps that each yield 1 + accepted tokens."""
        if self.cfg.accept_len is None or tokens < 2:
            return
        per_step = self.cfg.accept_len - 1.0
        remaining = tokens - 1
        with self.lock:
            while remaining > 0:
                self._carry += per_step
                acc = min(int(self._carry), self.cfg.num_spec_tokens, remaining - 1)
                acc = max(acc, 0)
                self._carry -= acc
                self.drafts += 1
                self.draft_tokens += self.cfg.num_spec_tokens
                self.accepted += acc
                for p in range(acc):
                    self.per_pos[p] += 1
                remaining -= 1 + acc

    def metrics(self) -> str:
        labels = f'engine="0",model_name="{self.cfg.model}"'
        lines = [
            "# HELP vllm:num_requests_running Number of requests in model execution batches.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} 0.0",
        ]
        if self.cfg.accept_len is not None:
            with self.lock:
                for name, value in (
                    ("vllm:spec_decode_num_drafts", self.drafts),
                    ("vllm:spec_decode_num_draft_tokens", self.draft_tokens),
                    ("vllm:spec_decode_num_accepted_tokens", self.accepted),
                ):
                    lines += [
                        f"# HELP {name}_total {name}.",
                        f"# TYPE {name}_total counter",
                        f"{name}_total{{{labels}}} {float(value)}",
                        f"# HELP {name}_created {name}.",
                        f"# TYPE {name}_created gauge",
                        f"{name}_created{{{labels}}} 1.7e+09",
                    ]
                name = "vllm:spec_decode_num_accepted_tokens_per_pos"
                lines += [f"# HELP {name}_total per position.", f"# TYPE {name}_total counter"]
                for p, value in enumerate(self.per_pos):
                    lines.append(f'{name}_total{{{labels},position="{p}"}} {float(value)}')
        return "\n".join(lines) + "\n"


def _handler(state: FakeState):
    cfg = state.cfg

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1" if cfg.chunked else "HTTP/1.0"

        def log_message(self, *args) -> None:  # quiet
            pass

        # --- helpers -------------------------------------------------------------
        def _json(self, status: int, obj) -> None:
            body = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            if not cfg.chunked:
                self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def _authorized(self) -> bool:
            if cfg.api_key and self.headers.get("Authorization") != f"Bearer {cfg.api_key}":
                self._json(401, {"error": "Unauthorized"})
                return False
            return True

        def _write_event(self, obj) -> None:
            data = b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"
            if cfg.chunked:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            else:
                self.wfile.write(data)
            self.wfile.flush()

        # --- routes -----------------------------------------------------------------
        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {})
            elif self.path == "/metrics":
                body = state.metrics().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            elif self.path == "/version":
                self._json(200, {"version": "0.23.0-fake"})
            elif self.path == "/v1/models":
                if self._authorized():
                    self._json(200, {"object": "list", "data": [{"id": cfg.model, "object": "model"}]})
            else:
                self._json(404, {"error": "not found"})

        def do_POST(self) -> None:
            t0 = time.perf_counter()
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            if not self._authorized():
                return
            chat = self.path == "/v1/chat/completions"
            if self.path not in ("/v1/completions", "/v1/chat/completions"):
                self._json(404, {"error": "not found"})
                return
            if chat and cfg.fail_chat_with:
                self._json(cfg.fail_chat_with, {"error": "injected failure"})
                return
            if body.get("model") != cfg.model:
                self._json(404, {"error": f"model {body.get('model')} does not exist"})
                return
            with state.lock:
                state.requests.append({"path": self.path, "body": body})
            pieces = self._tokens(body, chat)
            state.account(len(pieces))
            if body.get("stream"):
                self._stream(body, chat, pieces, t0)
            else:
                self._sleep_until(t0 + cfg.ttft_s + (len(pieces) - 1) / cfg.decode_tok_s)
                text = "".join(pieces)
                choice = (
                    {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                    if chat else {"index": 0, "text": text, "finish_reason": "length"}
                )
                self._json(200, {
                    "id": "x", "object": "chat.completion" if chat else "text_completion",
                    "model": cfg.model, "choices": [choice],
                    "usage": {"prompt_tokens": 10, "completion_tokens": len(pieces),
                              "total_tokens": 10 + len(pieces)},
                })

        def _tokens(self, body: dict, chat: bool) -> List[str]:
            max_tokens = int(body.get("max_tokens") or 16)
            prompt = body.get("prompt") or json.dumps(body.get("messages"))
            if "capital of France" in prompt:
                return [cfg.smoke_answer][:max_tokens]
            n = max_tokens
            if cfg.natural_tokens is not None and not body.get("ignore_eos"):
                n = max(min(max_tokens, cfg.natural_tokens), int(body.get("min_tokens") or 0))
            return [f" t{i}" for i in range(n)]

        @staticmethod
        def _sleep_until(target: float) -> None:
            delay = target - time.perf_counter()
            if delay > 0:
                time.sleep(delay)

        def _stream(self, body: dict, chat: bool, pieces: List[str], t0: float) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            if cfg.chunked:
                self.send_header("Transfer-Encoding", "chunked")
            else:
                self.send_header("Connection", "close")
            self.end_headers()
            if chat:  # vLLM opens a chat stream with an empty role delta
                self._write_event({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            # The first token comes alone (prefill), the rest in bursts of tokens_per_chunk
            # (as accepted speculative blocks arrive).
            step = max(1, cfg.tokens_per_chunk)
            starts = [0] + list(range(1, len(pieces), step)) if pieces else []
            for n, start in enumerate(starts):
                chunk = pieces[start:(starts[n + 1] if n + 1 < len(starts) else len(pieces))]
                last = start + len(chunk) - 1
                self._sleep_until(t0 + cfg.ttft_s + last / cfg.decode_tok_s)
                text = "".join(chunk)
                if chat:
                    kind = cfg.chat_kinds[start % len(cfg.chat_kinds)]
                    if kind == "reasoning":
                        delta = {"reasoning_content": text}
                    elif kind == "tool_calls":
                        delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
                    else:
                        delta = {"content": text}
                    event = {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                else:
                    event = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
                self._write_event(event)
            include_usage = (body.get("stream_options") or {}).get("include_usage")
            if cfg.usage and include_usage:
                self._write_event({"choices": [], "usage": {
                    "prompt_tokens": 10, "completion_tokens": len(pieces), "total_tokens": 10 + len(pieces)}})
            self._write_event(b"[DONE]")
            if cfg.chunked:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

    return Handler


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        # A client that hangs up mid-stream (a failed check, a timeout) is not news.
        pass


class FakeServer:
    """``with FakeServer(FakeConfig(...)) as srv: srv.base_url``"""

    def __init__(self, cfg: Optional[FakeConfig] = None, port: int = 0) -> None:
        self.cfg = cfg or FakeConfig()
        self.state = FakeState(self.cfg)
        self.httpd = _QuietServer(("127.0.0.1", port), _handler(self.state))
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
