"""The OpenAI-compatible HTTP API, as vLLM 0.23 serves it, over the timed engine.

Routes: ``/health``, ``/ping``, ``/version``, ``/metrics``, ``/v1/models``,
``/v1/completions``, ``/v1/chat/completions`` (SSE streaming with
``stream_options.include_usage``); ``--api-key`` / ``VLLM_API_KEY`` guard ``/v1/*``
(and ``/v2``, ``/inference``, as vLLM's AuthenticationMiddleware does); every other route
answers anyone. ``--middleware`` classes run in front of that, as ASGI middleware around
the routes (``Engine.admitted``): one that answers itself (a 401) ends the request there.
``POST /_sim/crash`` makes the process exit 1 at once (a dead engine, for restart tests);
``POST /_sim/wedge`` wedges it: ``/health`` and ``/v1/models`` still answer 200, but no
request produces another token and new ones queue forever (the wedge of vLLM #56824 and
NVIDIA open-gpu-kernel-modules #1358), until the process ends.
``POST /_sim/accept`` with ``{"length": L}`` makes every later request of a speculative
profile accept ``L`` tokens per step (a drafter that no longer matches its model, e.g. a
target replaced in place under a pinned drafter), until the process ends.

Timing is the known truth the benches are checked against: each request's first token
comes ``perf.ttft_s(prompt)`` after it arrives, then its tokens in accepted blocks, each
block due ``size / rate x slowdown(streams decoding)`` after the previous one on an
absolute monotonic schedule (no drift). ``n``, ``stop``, ``logprobs`` and sampling
parameters are accepted and ignored. ``usage.prompt_tokens`` is what the snapshot's
tokenizer counts for the prompt (for a chat, the chat template's text), as a client that
tokenizes with ``AutoTokenizer`` and ``apply_chat_template`` counts it.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from . import perf, text
from .flags import VERSION
from .logs import LOG_LOCK, log
from .metrics import Metrics
from .parsers import XML_TOOL_PARSERS, OutputParser, tool_properties
from .tokenizer import Tokenizer, for_snapshot


@dataclass
class Faults:
    """What only an in-process server (``local.SimServer``) can be told to get wrong, so
    that the checks' failure paths meet a real server: never set from the command line."""
    wrong_answer: str | None = None  # the model answers this to every prompt
    fail_status: dict[str, int] = field(default_factory=dict)  # path -> HTTP status
    close_delimited: bool = False  # SSE without chunked encoding, as some proxies send it
    requests: list[dict[str, Any]] | None = None  # when a list, every generation request body


@dataclass
class Plan:
    """What one request will produce, token by token (raw model output)."""
    n_tokens: int
    finish_reason: str
    tokens: Iterator[str]
    workload: str


def plan_output(answer: list[str], filler: Iterator[str], limit: int, min_tokens: int,
                ignore_eos: bool) -> tuple[int, str, Iterator[str]]:
    """Apply max_tokens (limit), min_tokens and ignore_eos to a natural answer."""
    natural = len(answer)
    if ignore_eos:
        n, reason = limit, "length"
    else:
        stop_at = max(natural, min_tokens)
        # Reaching max_tokens is "length" even if EOS would have come next.
        n, reason = (stop_at, "stop") if stop_at < limit else (limit, "length")

    def gen() -> Iterator[str]:
        for i, tok in enumerate(answer):
            if i >= n:
                return
            yield tok
        for _ in range(n - natural):
            yield next(filler)

    return n, reason, gen()


class ClientGone(Exception):
    """The client closed the stream; the request is aborted."""


@dataclass
class Engine:
    served_names: list[str]
    model: str
    max_model_len: int
    perf: perf.PerfModel
    api_keys: list[str] = field(default_factory=list)
    enable_auto_tools: bool = False
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    max_num_seqs: int = 256
    access_log: bool = False
    snapshot: Path | None = None
    middleware: list[type] = field(default_factory=list)  # --middleware classes, in flag order
    faults: Faults = field(default_factory=Faults)
    metrics: Metrics = field(init=False)
    tokenizer: Tokenizer = field(init=False)  # the snapshot's, read once; counts prompt tokens
    wedged: threading.Event = field(init=False, default_factory=threading.Event)  # POST /_sim/wedge
    slots: threading.BoundedSemaphore = field(init=False)
    _planners: dict[str, perf.StepPlanner] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.served_names[0], self.perf.k)
        self.slots = threading.BoundedSemaphore(self.max_num_seqs)
        self.tokenizer = for_snapshot(self.snapshot)
        self.tokenizer.count("warm up: the first request pays no table building")

        async def routes(scope: dict, receive: Any, send: Any) -> None:
            scope["extensions"]["sparkfleet.sim"].append("routes")

        app: Any = routes
        for cls in self.middleware:  # Starlette: the middleware added last is the outermost
            app = cls(app)
        self._asgi = app

    def admitted(self, scope: dict, body: bytes) -> tuple[bool, int, list[tuple[bytes, bytes]], bytes]:
        """Run the ``--middleware`` chain for one request: (passed on to the routes, or
        the status, headers and body the middleware answered with)."""
        if not self.middleware:
            return True, 0, [], b""
        reached: list[str] = []
        scope["extensions"] = {"sparkfleet.sim": reached}
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        asyncio.run(self._asgi(scope, receive, send))
        if reached:
            return True, 0, [], b""
        start = next((m for m in sent if m["type"] == "http.response.start"), None)
        if start is None:
            return False, 500, [], b"middleware sent no response"
        return (False, start["status"], list(start.get("headers") or []),
                b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))

    def planner(self, workload: str) -> perf.StepPlanner:
        with self.metrics.lock:
            if workload not in self._planners:
                self._planners[workload] = perf.StepPlanner(self.perf.speed(workload).accept, self.perf.k)
            return self._planners[workload]

    def run(self, prompt_tokens: int, plan: Plan, emit: Callable[[list[str]], None]) -> int:
        """Produce ``plan`` on the simulated clock, calling ``emit`` per token block.

        Returns the number of tokens produced (less than planned if the client left)."""
        m = self.metrics
        t0 = time.monotonic()
        with m.lock:
            m.waiting += 1
        self.slots.acquire()
        with m.lock:
            m.waiting -= 1
            m.running += 1
        produced = 0
        outcome = "abort"
        try:
            rate = self.perf.speed(plan.workload).tok_s
            blocks = self.planner(plan.workload).blocks(plan.n_tokens)
            due = t0 + self.perf.ttft_s(prompt_tokens)
            with m.lock:
                m.prompt_tokens += prompt_tokens
            for i, size in enumerate(blocks):
                if i:
                    with m.lock:
                        streams = m.running
                    due += size / rate * perf.slowdown(plan.workload, streams)
                _sleep_until(due)
                while self.wedged.is_set():  # alive, answering, and never producing again
                    time.sleep(0.5)
                tokens = [next(plan.tokens) for _ in range(size)]
                if i == 0:
                    with m.lock:
                        m.ttft.observe(time.monotonic() - t0)
                        m.generation_tokens += size
                else:
                    m.decode_step(size)
                produced += size
                emit(tokens)
            outcome = "length" if plan.finish_reason == "length" else "stop"
        except ClientGone:
            outcome = "abort"
        finally:
            with m.lock:
                m.running -= 1
                m.success[outcome] += 1
                m.e2e.observe(time.monotonic() - t0)
            self.slots.release()
        return produced


def _sleep_until(deadline: float) -> None:
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        time.sleep(remaining)


class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def _int_param(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ApiError(400, f"{name} must be a non-negative integer, got {value!r}", param=name)
            return value
    return None


class EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], engine: Engine) -> None:
        self.engine = engine
        super().__init__(addr, _Handler)


#: Bytes per chunk of /metrics: small enough that a body of vLLM's size is cut mid-line.
METRICS_CHUNK = 1000


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: EngineHTTPServer
    server_version = "uvicorn"
    sys_version = ""

    def setup(self) -> None:
        super().setup()
        # Token deltas are tiny writes: without NODELAY, Nagle + delayed ACK skews timing.
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        if self.server.engine.access_log and self.path not in ("/health", "/metrics"):
            try:
                phrase = f"{int(code)} {self.responses.get(int(code), ('',))[0]}"
            except (TypeError, ValueError):
                phrase = str(code)
            with LOG_LOCK:
                print(f'INFO:     {self.client_address[0]}:{self.client_address[1]} - "{self.requestline}" {phrase}',
                      file=sys.stderr, flush=True)

    # -- plumbing -----------------------------------------------------------------------
    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _plain(self, status: int, body_text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        body = body_text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _chunked(self, body_text: str, content_type: str) -> None:
        """As uvicorn sends an ASGI answer without Content-Length (vLLM's /metrics is
        prometheus_client's ASGI app): chunked, to an HTTP/1.0 client too, in pieces that
        cut lines."""
        body = body_text.encode()
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        for start in range(0, len(body), METRICS_CHUNK):
            piece = body[start:start + METRICS_CHUNK]
            self.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        self.wfile.write(b"0\r\n\r\n")

    def _authorized(self) -> bool:
        keys = self.server.engine.api_keys
        if not keys:
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and any(
            hashlib.sha256(token.encode()).digest() == hashlib.sha256(k.encode()).digest() for k in keys)

    def _scope(self, method: str, path: str) -> dict[str, Any]:
        """The ASGI scope uvicorn would give this request."""
        target, _, query = self.path.partition("?")
        return {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
            "scheme": "http", "path": unquote(path), "raw_path": target.encode(), "root_path": "",
            "query_string": query.encode(), "client": self.client_address[:2],
            "server": self.server.server_address[:2],
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()],
        }

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        body_bytes = b""
        if method == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            body_bytes = self.rfile.read(length) if length else b""
        passed, status, headers, answer = self.server.engine.admitted(self._scope(method, path), body_bytes)
        if not passed:
            self.send_response(status)
            for name, value in headers:
                self.send_header(name.decode("latin-1"), value.decode("latin-1"))
            if not any(name.lower() == b"content-length" for name, _ in headers):
                self.send_header("Content-Length", str(len(answer)))
            self.end_headers()
            self.wfile.write(answer)
            return None
        if path.startswith(("/v1", "/v2", "/inference", "/_sim")) and not self._authorized():
            return self._json(401, {"error": "Unauthorized"})
        routes: dict[tuple[str, str], Callable[..., None]] = {
            ("GET", "/health"): lambda: self._plain(200, "", "application/json"),
            ("GET", "/ping"): lambda: self._plain(200, "", "application/json"),
            ("GET", "/version"): lambda: self._json(200, {"version": VERSION}),
            ("GET", "/metrics"): lambda: self._chunked(
                self.server.engine.metrics.render(), "text/plain; version=0.0.4; charset=utf-8"),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): lambda: self._generate(body_bytes, chat=False),
            ("POST", "/v1/chat/completions"): lambda: self._generate(body_bytes, chat=True),
            ("POST", "/_sim/crash"): self._crash,
            ("POST", "/_sim/wedge"): self._wedge,
            ("POST", "/_sim/accept"): lambda: self._accept(body_bytes),
        }
        handler = routes.get((method, path))
        if path in self.server.engine.faults.fail_status:
            return self._json(self.server.engine.faults.fail_status[path], {"error": "injected failure"})
        if handler is None:
            if any(p == path for _, p in routes):
                return self._json(405, {"detail": "Method Not Allowed"})
            return self._json(404, {"detail": "Not Found"})
        try:
            handler()
        except ApiError as err:
            self._json(err.status, err.body())
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    # -- endpoints ----------------------------------------------------------------------
    def _crash(self) -> None:
        log("ERROR", "core_client.py:564", "Engine core proc EngineCore_DP0 died unexpectedly (simulated crash).")
        os._exit(1)

    def _wedge(self) -> None:
        self.server.engine.wedged.set()
        log("WARNING", "sim", "engine wedged (simulated): /health answers, no token comes")
        self._json(200, {"wedged": True})

    def _accept(self, body_bytes: bytes) -> None:
        eng = self.server.engine
        try:
            length = float(json.loads(body_bytes or b"{}")["length"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ApiError(400, f'expected {{"length": <tokens per step>}}: {exc}', param="length") from exc
        if eng.perf.method is None or not 1.0 <= length <= eng.perf.k + 1:
            raise ApiError(400, f"length must be 1..{eng.perf.k + 1} on a speculative profile", param="length")
        with eng.metrics.lock:
            eng.perf = replace(eng.perf, accept_len=length)
            eng._planners.clear()
        log("WARNING", "sim", f"drafter mismatch (simulated): acceptance length {length:g} from now on")
        self._json(200, {"length": length})

    def _models(self) -> None:
        eng = self.server.engine
        now = int(time.time())
        data = [{
            "id": name, "object": "model", "created": now, "owned_by": "vllm", "root": eng.model,
            "parent": None, "max_model_len": eng.max_model_len,
            "permission": [{
                "id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": now,
                "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                "organization": "*", "group": None, "is_blocking": False,
            }],
        } for name in eng.served_names]
        self._json(200, {"object": "list", "data": data})

    def _generate(self, body_bytes: bytes, chat: bool) -> None:
        eng = self.server.engine
        try:
            body = json.loads(body_bytes or b"null")
        except ValueError as exc:
            raise ApiError(400, f"JSON decode error: {exc}") from exc
        if not isinstance(body, dict):
            raise ApiError(400, "Input should be a valid dictionary")
        if eng.faults.requests is not None:
            eng.faults.requests.append({"path": self.path, "body": body})
        model = body.get("model") or eng.served_names[0]
        if model not in eng.served_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

        if chat:
            prompt_tokens, answer, filler, workload, parser, tool_finish = self._chat_request(body)
        else:
            prompt_tokens, answer, filler, workload = self._completion_request(body)
            parser, tool_finish = None, None
        max_tokens = _int_param(body, "max_completion_tokens", "max_tokens") if chat else _int_param(body, "max_tokens")
        if not chat and max_tokens is None:
            max_tokens = 16  # vLLM's CompletionRequest default
        if max_tokens is not None and max_tokens < 1:
            raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", param="max_tokens")
        min_tokens = _int_param(body, "min_tokens") or 0
        room = eng.max_model_len - prompt_tokens
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"This model's maximum context length is {eng.max_model_len} tokens. However, you "
                                f"requested {max_tokens} output tokens and your prompt contains {prompt_tokens} input "
                                f"tokens, for a total of {prompt_tokens + max_tokens} tokens. Please reduce the length "
                                "of the input prompt or the number of requested output tokens.", param="input_tokens")
        limit = room if max_tokens is None else max_tokens
        if min_tokens > limit:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={limit}, got {min_tokens}.",
                           param="min_tokens")
        n, reason, tokens = plan_output(answer, filler, limit, min_tokens, bool(body.get("ignore_eos")))
        if tool_finish is not None and reason == "stop":
            reason = tool_finish
        plan = Plan(n_tokens=n, finish_reason=reason, tokens=tokens, workload=workload)
        stream_opts = body.get("stream_options") or {}
        if body.get("stream"):
            self._stream(model, prompt_tokens, plan, parser, bool(stream_opts.get("include_usage")),
                         bool(stream_opts.get("continuous_usage_stats")), chat)
        else:
            self._complete(model, prompt_tokens, plan, parser, chat)

    def _natural(self, tokens: list[str]) -> list[str]:
        wrong = self.server.engine.faults.wrong_answer
        return text.pieces_of(wrong) if wrong is not None else tokens

    def _completion_request(self, body: dict[str, Any]) -> tuple[int, list[str], Iterator[str], str]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_text, prompt_tokens = " ".join(map(str, prompt)), len(prompt)
        else:
            if isinstance(prompt, list):
                prompt = prompt[0] if prompt else None
            if not isinstance(prompt, str):
                raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
            prompt_text, prompt_tokens = prompt, max(1, text.count_tokens(prompt, self.server.engine.tokenizer))
        natural, filler = text.completion_output(prompt_text)
        return prompt_tokens, self._natural(natural), filler, text.completion_workload(prompt_text)

    def _chat_request(self, body: dict[str, Any]) -> tuple[int, list[str], Iterator[str], str, OutputParser,
                                                           str | None]:
        eng = self.server.engine
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects", param="messages")
        tools = body.get("tools") or []
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        # vLLM 0.23 (entrypoints/serve/render/serving.py): no tool parser, no tool choice.
        if tools and tool_choice not in (None, "none") and not eng.tool_parser:
            if tool_choice == "auto":
                raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                    "to be set")
            raise ApiError(400, f'tool_choice="{tool_choice}" requires --tool-call-parser to be set')
        kwargs = body.get("chat_template_kwargs") or {}
        thinking = kwargs.get("enable_thinking", True) is not False  # Qwen3.5 thinks by default
        prompt_tokens = text.chat_prompt_tokens(messages, tools, thinking, eng.tokenizer)
        auto = tool_choice in (None, "auto")
        parses_tools = bool(tools) and eng.tool_parser in XML_TOOL_PARSERS and (eng.enable_auto_tools or not auto)
        raw, filler, calls = text.chat_output(messages, tools, tool_choice if tools else None, thinking)
        if eng.faults.wrong_answer is not None and not calls:
            raw = self._natural(raw)
        parser = OutputParser(reasoning=bool(eng.reasoning_parser) and thinking,
                              tools=tool_properties(tools) if parses_tools else None)
        # "tool_calls" for auto and required, "stop" for a named tool (vLLM's rule).
        tool_finish = ("tool_calls" if auto or tool_choice == "required" else "stop") if calls and parses_tools else None
        return prompt_tokens, raw, filler, text.chat_workload(messages, tools), parser, tool_finish

    def _usage(self, prompt_tokens: int, n: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                "prompt_tokens_details": None}

    def _complete(self, model: str, prompt_tokens: int, plan: Plan, parser: OutputParser | None, chat: bool) -> None:
        raw: list[str] = []
        produced = self.server.engine.run(prompt_tokens, plan, lambda tokens: raw.extend(tokens))
        created = int(time.time())
        usage = self._usage(prompt_tokens, produced)
        if not chat or parser is None:
            self._json(200, {
                "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": "".join(raw), "logprobs": None,
                             "finish_reason": plan.finish_reason, "stop_reason": None, "prompt_logprobs": None}],
                "usage": usage, "system_fingerprint": None, "kv_transfer_params": None,
            })
            return
        parser.feed(raw)
        reasoning, content, tool_calls = parser.message()
        message = {"role": "assistant", "content": content, "refusal": None, "annotations": None, "audio": None,
                   "function_call": None, "tool_calls": tool_calls, "reasoning": reasoning}
        self._json(200, {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": plan.finish_reason,
                         "stop_reason": None, "token_ids": None}],
            "service_tier": None, "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
            "prompt_token_ids": None, "kv_transfer_params": None,
        })

    def _stream(self, model: str, prompt_tokens: int, plan: Plan, parser: OutputParser | None,
                include_usage: bool, continuous_usage: bool, chat: bool) -> None:
        chunked = not self.server.engine.faults.close_delimited
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding" if chunked else "Connection", "chunked" if chunked else "close")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        state = {"produced": 0, "first": True}

        def send(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            try:
                self.wfile.write(f"{len(payload):X}\r\n".encode() + payload + b"\r\n" if chunked else payload)
                self.wfile.flush()
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise ClientGone() from exc

        def chunk(choice: dict[str, Any]) -> None:
            msg: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage and continuous_usage:
                msg["usage"] = self._usage(prompt_tokens, state["produced"])
            send(json.dumps(msg))

        def emit(tokens: list[str]) -> None:
            state["produced"] += len(tokens)
            last = state["produced"] >= plan.n_tokens
            finish = plan.finish_reason if last else None
            if not chat or parser is None:
                chunk({"index": 0, "text": "".join(tokens), "logprobs": None, "finish_reason": finish,
                       "stop_reason": None})
                return
            if state["first"]:
                state["first"] = False
                chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})
            delta = parser.feed(tokens)
            if delta or last:  # vLLM sends no chunk for tokens that only the parser saw
                chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})

        try:
            produced = self.server.engine.run(prompt_tokens, plan, emit)
            if include_usage:
                send(json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                 "usage": self._usage(prompt_tokens, produced)}))
            send("[DONE]")
            if chunked:
                self.wfile.write(b"0\r\n\r\n")
            else:
                self.close_connection = True
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            self.close_connection = True
