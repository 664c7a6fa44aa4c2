"""Startup: ``vllm serve MODEL [flags]`` from argv to a listening server, as vLLM starts.

Everything vLLM checks before it binds (parsers, the speculative config, the model and
the drafter in the local cache) fails here with vLLM's message and exit 1. The engine
binds only when "loaded" (after ``SIM_READY_DELAY_S``), logs vLLM's periodic stats lines,
and exits 0 on SIGTERM.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from . import multinode, perf
from .api import Engine, EngineHTTPServer
from .boot import Boot
from .cache import derived_max_model_len, read_config, resolve_model
from .flags import (
    _SPEC_METHODS_WITHOUT_MODEL,
    MTP_METHODS,
    VERSION,
    ReasoningParserManager,
    ToolParserManager,
    build_parser,
    parse_speculative_config,
    serve_parser,
    validate_parsed_serve_args,
)
from .logs import LOG_LOCK, StartupError, log
from .memory import Memory

# The int8 lm-head patch's marker in the installed vLLM (runtime/patches/int8_lmhead.py).
INT8_LM_HEAD_FILE = "vllm/model_executor/layers/logits_processor.py"
INT8_LM_HEAD_MARK = "[sparkfleet:int8_lmhead]"


def int8_lm_head_patched(env: dict[str, str]) -> bool:
    """Whether the vLLM this engine stands in for carries the int8 lm-head patch: the
    serve wrapper applies it to the real vLLM source in the image before starting us."""
    root = env.get("SPARKFLEET_VLLM_ROOT")
    if root:
        path = Path(root) / INT8_LM_HEAD_FILE
    else:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return False
        path = Path(list(spec.submodule_search_locations)[0]).parent / INT8_LM_HEAD_FILE
    try:
        return INT8_LM_HEAD_MARK in path.read_text(errors="replace")
    except OSError:
        return False


def levers_of(model: str, config: dict[str, Any], env: dict[str, str]) -> perf.Levers:
    return perf.Levers(
        fp8_shared_experts="fp8-hybrid" in model.lower() or bool(config.get("sparkfleet_hybrid")),
        int8_lm_head=int8_lm_head_patched(env),
    )


def method_of(spec_method: str | None) -> str | None:
    """The performance model's name for a speculative method (every MTP head is "mtp")."""
    if spec_method is None:
        return None
    return "mtp" if spec_method in MTP_METHODS else spec_method


def _non_default_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> dict[str, Any]:
    out = {}
    for action in parser._actions:  # noqa: SLF001
        if action.dest in ("help",):
            continue
        value = getattr(args, action.dest, None)
        if value != action.default:
            out[action.dest] = "******" if action.dest in ("api_key", "hf_token") else value
    return out


class _StatsLogger(threading.Thread):
    """vLLM's periodic 'Engine 000: ...' and 'SpecDecoding metrics: ...' lines."""

    def __init__(self, engine: Engine, interval_s: float = 10.0) -> None:
        super().__init__(name="stats-logger", daemon=True)
        self.engine, self.interval = engine, interval_s

    def run(self) -> None:
        m = self.engine.metrics
        with m.lock:
            last = (m.prompt_tokens, m.generation_tokens, m.drafts, m.accepted, m.draft_tokens)
        while True:
            time.sleep(self.interval)
            with m.lock:
                now = (m.prompt_tokens, m.generation_tokens, m.drafts, m.accepted, m.draft_tokens)
                running, waiting = m.running, m.waiting
            if now == last and not running:
                continue
            d = [a - b for a, b in zip(now, last)]
            last = now
            log("INFO", "loggers.py:257", f"Engine 000: Avg prompt throughput: {d[0] / self.interval:.1f} tokens/s, "
                f"Avg generation throughput: {d[1] / self.interval:.1f} tokens/s, Running: {running} reqs, "
                f"Waiting: {waiting} reqs, GPU KV cache usage: {min(100.0, running):.1f}%, "
                "Prefix cache hit rate: 0.0%")
            if self.engine.perf.k and d[2]:
                log("INFO", "metrics.py:100", f"SpecDecoding metrics: Mean acceptance length: {1 + d[3] / d[2]:.2f}, "
                    f"Accepted throughput: {d[3] / self.interval:.2f} tokens/s, Drafted throughput: "
                    f"{d[4] / self.interval:.2f} tokens/s, Accepted: {d[3]} tokens, Drafted: {d[4]} tokens, "
                    f"Avg Draft acceptance rate: {100.0 * d[3] / max(1, d[4]):.1f}%")


def _imported_middleware(path: str) -> type:
    """One ``--middleware`` import path, as vLLM's build_app imports it (at startup, so a
    bad path fails the start). A class is mounted like ``app.add_middleware``; vLLM also
    takes an ``@app.middleware("http")`` function, which the simulator does not run."""
    module_path, _, name = path.rpartition(".")
    try:
        imported = getattr(importlib.import_module(module_path), name)
    except (ImportError, AttributeError, ValueError) as exc:
        raise StartupError(f"{type(exc).__name__}: {exc}") from None
    if inspect.isclass(imported):
        return imported
    if inspect.iscoroutinefunction(imported):
        raise StartupError(f"NotImplementedError: the simulator mounts ASGI classes only, not {path}")
    raise StartupError(f"ValueError: Invalid middleware {path}. Must be a function or a class.")


def build_engine(args: argparse.Namespace, env: dict[str, str]) -> Engine:
    """Everything vLLM checks before it binds: parsers, spec config, model, drafter."""
    try:
        validate_parsed_serve_args(args)
    except TypeError as exc:
        raise StartupError(f"TypeError: {exc}") from None
    # vLLM's validate_api_server_args, on the same names the check asks for.
    tools = ToolParserManager.list_registered()
    if args.enable_auto_tool_choice and args.tool_call_parser not in tools:
        raise StartupError(f"KeyError: 'invalid tool call parser: {args.tool_call_parser} "
                           f"(chose from {{ {','.join(tools)} }})'")
    reasoning = ReasoningParserManager.list_registered()
    if args.reasoning_parser and args.reasoning_parser not in reasoning:
        raise StartupError(f"KeyError: 'invalid reasoning parser: {args.reasoning_parser} "
                           f"(chose from {{ {','.join(reasoning)} }})'")
    raw_spec = args.speculative_config
    if args.spec_method or args.spec_model or args.spec_tokens:
        raw_spec = dict(raw_spec or {})
        for key, value in (("method", args.spec_method), ("model", args.spec_model),
                           ("num_speculative_tokens", args.spec_tokens)):
            if value is not None:
                raw_spec[key] = value
    spec = parse_speculative_config(raw_spec)

    model = args.model_tag or args.model
    if not model:
        raise StartupError("ValueError: a model must be given: `vllm serve <model>`")
    log("INFO", "model.py:559", f"Resolving model {model} (revision {args.revision or 'main'}) from the local cache")
    snapshot = resolve_model(model, args.revision, env)
    config = read_config(snapshot)
    arch = (config.get("architectures") or ["?"])[0]
    log("INFO", "model.py:1725", f"Resolved architecture: {arch}")
    derived = derived_max_model_len(config)
    max_len = args.max_model_len if args.max_model_len not in (None, -1) else derived
    if max_len > derived:
        raise StartupError(f"ValueError: User-specified max_model_len ({max_len}) is greater than the derived "
                           f"max_model_len (max_position_embeddings={derived} in model's config.json).")
    log("INFO", "model.py:1766", f"Using max model len {max_len}")
    if spec is not None:
        log("INFO", "speculative.py:600", f"Speculative decoding: method={spec.method}, "
            f"num_speculative_tokens={spec.num_speculative_tokens}, model={spec.model}")
        if spec.model and spec.method not in _SPEC_METHODS_WITHOUT_MODEL:
            drafter = resolve_model(spec.model, spec.revision, env, what="draft model")
            log("INFO", "speculative.py:640", f"Draft model {spec.model} found at {drafter}")
    model_perf = perf.perf_model(method_of(spec.method if spec else None), spec.num_speculative_tokens if spec else 0,
                                 levers_of(model, config, env), env)
    middleware = [_imported_middleware(path) for path in args.middleware]
    served = args.served_model_name or [model]
    api_keys = [k for k in (args.api_key or [env.get("VLLM_API_KEY", "")]) if k]
    return Engine(
        served_names=served, model=model, snapshot=snapshot, max_model_len=max_len, perf=model_perf,
        api_keys=api_keys, enable_auto_tools=bool(args.enable_auto_tool_choice), tool_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser or None, max_num_seqs=args.max_num_seqs or 256,
        access_log=not args.disable_uvicorn_access_log, middleware=middleware,
    )


def cmd_serve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    env = dict(os.environ)
    stop = threading.Event()

    def _on_signal(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)

    log("INFO", "utils.py:253", f"vLLM API server version {VERSION} (sparkfleet simulator)")
    log("INFO", "utils.py:253", f"non-default args: {_non_default_args(args, parser)}")
    engine = build_engine(args, env)
    memory = Memory(env)  # held until the process ends: the host's memory is ours
    final_gib = memory.check(args.gpu_memory_utilization)  # vLLM's worker checks before anything loads
    group = multinode.join(args, env, engine, stop)  # None on one node
    if group is not None and group.headless:
        return group.run_headless(stop)
    prof = engine.perf
    speeds = ", ".join(f"{w} {s.tok_s:.1f} tok/s (acc {s.accept:.2f})"
                       for w in perf.WORKLOADS for s in [prof.speed(w)])
    log("INFO", "sim", f"SIMULATED engine ({prof.label}): {speeds}; TTFT {prof.ttft_s(0):g} s + prompt / "
        f"{prof.prefill_tok_s:g} tok/s")
    log("INFO", "gpu_model_runner.py:2602", f"Starting to load model {engine.snapshot}...")
    if env.get("SIM_READY_DELAY_S", "").strip():  # a fixed delay (the engine's own tests)
        if stop.wait(prof.ready_delay_s):
            log("INFO", "launcher.py:110", "Shutting down before startup completed.")
            return 0
        log("INFO", "gpu_model_runner.py:2634", f"Model loading took {63.1 if prof.levers.fp8_shared_experts else 61.5} "
            f"GiB memory and {prof.ready_delay_s:.2f} seconds")
    else:  # as long as a GB10 takes for what it loads (boot.py, runtime/startup.py)
        config = read_config(engine.snapshot)
        key = f"{engine.model}|{prof.method}|{prof.k}|{env.get('SF_PATCHES', '')}"
        boot = Boot(env, engine.model, config, key, args.load_format, bool(prof.k and prof.method == "dflash"),
                    memory, final_gib, pair=group is not None)
        if not boot.run(stop):
            log("INFO", "launcher.py:110", "Shutting down before startup completed.")
            return 0
    host = args.host if args.host is not None else "0.0.0.0"
    try:
        httpd = EngineHTTPServer((host, args.port), engine)
    except OSError as exc:
        raise StartupError(f"OSError: [Errno {exc.errno}] error while attempting to bind on address "
                           f"('{host}', {args.port}): {exc.strerror}") from exc
    log("INFO", "api_server.py:583", f"Starting vLLM server on http://{host}:{args.port}")
    log("INFO", "launcher.py:37", "Available routes are: /health, /ping, /version, /metrics, /v1/models, "
        "/v1/completions, /v1/chat/completions")
    failed: list[BaseException] = []

    def _serve() -> None:
        try:
            httpd.serve_forever(poll_interval=0.2)
        except BaseException as exc:  # noqa: BLE001 - a dead server is a dead engine
            failed.append(exc)
            stop.set()

    threading.Thread(target=_serve, name="http", daemon=True).start()
    if not args.disable_log_stats:
        _StatsLogger(engine).start()
    with LOG_LOCK:
        print(f"INFO:     Started server process [{os.getpid()}]\nINFO:     Waiting for application startup.\n"
              "INFO:     Application startup complete.", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    log("INFO", "launcher.py:110", "Shutting down FastAPI HTTP server.")
    httpd.shutdown()
    httpd.server_close()
    if failed:
        raise failed[0]
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)  # exits 2 on an unknown flag, as vLLM's parser
    if args.subparser != "serve":
        parser.print_help()
        return 0
    try:
        return cmd_serve(args, serve_parser())
    except StartupError as exc:
        log("ERROR", "api_server.py:1004", "EngineCore failed to start.")
        print(f"Traceback (most recent call last):\n  (simulated)\n{exc}", file=sys.stderr, flush=True)
        return 1
    except Exception:  # noqa: BLE001 - any other failure: traceback and a non-zero exit
        traceback.print_exc()
        return 1


