#!/usr/bin/env python3
"""Simulated vLLM 0.23 for the sparkfleet testbed: ``vllm serve MODEL [flags]``.

Installed as ``/usr/local/bin/vllm`` in the simulated serving image (stdlib only, Python
3.11). It behaves like vLLM where the deploy and the checks can tell the difference, and
nowhere else:

* CLI: the ``vllm serve`` flags sparkfleet uses and the common ones, with vLLM's
  spellings (``--no-`` forms, ``_`` for ``-``, ``--x.key value``, ``-O3``); an unknown flag
  exits 2 with argparse's "unrecognized arguments"; a malformed ``--speculative-config``,
  an unknown tool/reasoning parser or ``--enable-auto-tool-choice`` without a parser fail
  at startup with vLLM's messages. ``tests/testbed/test_engine_flags.py`` checks every
  accepted flag against the real vLLM 0.23 source.
* Model resolution from the local HF cache only (``$HF_HUB_CACHE`` or ``$HF_HOME/hub``),
  honouring ``--revision``; the DFlash drafter in the speculative config too. It never
  downloads: a missing snapshot or weight shard is a startup error.
* Binds only when "loaded" (after ``SIM_READY_DELAY_S``), then serves ``/health``,
  ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming with
  ``stream_options.include_usage``), ``/metrics`` with vLLM's metric names, ``/version``.
  ``--api-key`` / ``VLLM_API_KEY`` guard ``/v1/*``.
* Timing is the known truth the benches are checked against: the first token comes
  exactly ``SIM_TTFT_S`` after the request, then token *i* at ``t_first + i / rate``
  (absolute schedule on a monotonic clock, so no drift). Under speculative decoding the
  tokens after the first arrive in accepted blocks whose mean size is the acceptance
  length, at the same long-run rate, and the ``vllm:spec_decode_*`` counters count
  exactly those blocks.

Counters: each decode step after the first token is one draft; a step that yields b
tokens adds 1 to ``spec_decode_num_drafts``, b - 1 to ``num_accepted_tokens`` (positions
0..b-2 to the per-position counters) and k to ``num_draft_tokens``, so 1 + accepted /
drafts = (n - 1) / steps is the acceptance length. The per-request step count is the
nearest to (n - 1) / accept_len, with the rounding carried across requests.

Text is deterministic per prompt: "capital of France" → "Paris."; counting, code, JSON
and prose prompts get matching filler; a reply ends by itself (finish "stop") unless
``ignore_eos``/``min_tokens``/``max_tokens`` say otherwise. With ``tools``, a tool call
comes when ``tool_choice`` requires one or the last user message names a tool (or says
"tool"/"function"). Reasoning (``--reasoning-parser``) is emitted only when the request
sets ``chat_template_kwargs.enable_thinking: true``. ``n``, ``stop``, ``logprobs`` and
sampling parameters are accepted and ignored.

Simulator-only knobs (environment): ``SIM_DECODE_TOK_S``, ``SIM_TTFT_S``,
``SIM_ACCEPT_LEN``, ``SIM_READY_DELAY_S`` (default 3). ``POST /_sim/crash`` makes the
process exit 1 at once (a dead engine, for restart tests; API key required when set).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import re
import signal
import socket
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Iterator

VERSION = "0.23.0"

# --------------------------------------------------------------------------------------
# Names vLLM 0.23 knows (checked against its source by tests/testbed/test_engine_flags.py)
# --------------------------------------------------------------------------------------
MTP_METHODS = frozenset({
    "deepseek_mtp", "mimo_mtp", "mimo_v2_mtp", "glm4_moe_mtp", "glm4_moe_lite_mtp", "glm_ocr_mtp",
    "ernie_mtp", "nemotron_h_mtp", "exaone_moe_mtp", "exaone4_5_mtp", "qwen3_next_mtp",
    "qwen3_5_mtp", "longcat_flash_mtp", "mtp", "pangu_ultra_moe_mtp", "step3p5_mtp", "hy_v3_mtp",
    "gemma4_mtp",
})
SPEC_METHODS = MTP_METHODS | frozenset({
    "ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "custom_class", "eagle", "eagle3",
    "extract_hidden_states", "dflash", "ngram_gpu",
})
# Methods that need no draft model of their own (vLLM fills ``model`` in for them).
_SPEC_METHODS_WITHOUT_MODEL = MTP_METHODS | {"ngram", "ngram_gpu", "suffix", "extract_hidden_states"}
# User-settable SpeculativeConfig fields (vLLM forbids extra keys).
SPEC_CONFIG_KEYS = frozenset({
    "enforce_eager", "num_speculative_tokens", "model", "method", "draft_tensor_parallel_size",
    "tensor_parallel_size", "quantization", "moe_backend", "attention_backend", "max_model_len",
    "revision", "code_revision", "disable_padded_drafter_batch", "use_local_argmax_reduction",
    "prompt_lookup_max", "prompt_lookup_min", "parallel_drafting", "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob", "draft_load_config", "rejection_sample_method",
    "synthetic_acceptance_rates", "synthetic_acceptance_length", "draft_sample_method",
})
TOOL_PARSERS = frozenset({
    "deepseek_v3", "deepseek_v31", "deepseek_v32", "deepseek_v4", "cohere_command3", "cohere_command4",
    "ernie45", "glm45", "glm47", "granite-20b-fc", "granite", "granite4", "hermes", "poolside_v1",
    "hunyuan_a13b", "hy_v3", "internlm", "jamba", "lfm2", "kimi_k2", "llama3_json", "llama4_json",
    "llama4_pythonic", "longcat", "mimo", "minimax_m2", "minimax", "minicpm5", "mistral", "olmo3",
    "openai", "phi4_mini_json", "pythonic", "qwen3_coder", "qwen3_xml", "seed_oss", "step3",
    "step3p5", "xlam", "gigachat3", "functiongemma", "gemma4", "apertus",
})
REASONING_PARSERS = frozenset({
    "deepseek_r1", "deepseek_v3", "deepseek_v4", "poolside_v1", "cohere_command3", "cohere_command4",
    "ernie45", "gemma4", "glm45", "openai_gptoss", "granite", "holo2", "hunyuan_a13b", "hy_v3",
    "kimi_k2", "mimo", "minimax_m2", "minimax_m2_append_think", "mistral", "nemotron_v3", "olmo3",
    "qwen3", "seed_oss", "step3", "step3p5",
})

# --------------------------------------------------------------------------------------
# Simulated performance: the seeds' measured numbers (GB10, c=1)
# --------------------------------------------------------------------------------------
DEFAULT_TTFT_S = 0.25
DEFAULT_READY_DELAY_S = 3.0
BASE_DECODE_TOK_S = 28.2  # plain INT4, no spec
HYBRID_DECODE_TOK_S = 36.0  # hybrid INT4+FP8 (+ int8 lm-head), no spec
MTP_DECODE_TOK_S, MTP_ACCEPT = 39.9, 2.88  # MTP-2 on Hermes turns
DFLASH_DECODE_TOK_S, DFLASH_ACCEPT = 81.0, 8.3  # DFlash n=12 on Hermes turns
OTHER_SPEC_DECODE_TOK_S, OTHER_SPEC_ACCEPT = 33.7, 2.3  # not measured by the seeds: prose-like


class StartupError(Exception):
    """Startup failed the way vLLM fails (message printed, exit 1)."""


# --------------------------------------------------------------------------------------
# Logging in vLLM's format
# --------------------------------------------------------------------------------------
_LOG_LOCK = threading.Lock()


def log(level: str, where: str, msg: str) -> None:
    stamp = time.strftime("%m-%d %H:%M:%S")
    with _LOG_LOCK:
        print(f"(APIServer pid={os.getpid()}) {level} {stamp} [{where}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------
def _human_int(value: str) -> int:
    """vLLM's human_readable_int: 1k = 1000, 1K = 1024, 25.6k = 25600."""
    value = value.strip()
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", value)
    if m:
        number, suffix = m.groups()
        if suffix.islower():
            return int(float(number) * 10 ** (3 * "kmgt".index(suffix) + 3))
        if "." in number:
            raise argparse.ArgumentTypeError(f"Decimals are not allowed with binary suffixes like {suffix}.")
        return int(number) * 2 ** (10 * "KMGT".index(suffix) + 10)
    return int(value)


def _human_int_or_auto(value: str) -> int:
    return -1 if value.strip() in ("-1", "auto") else _human_int(value)


def loads(value: str) -> Any:
    """json.loads under its own name, so argparse says 'invalid loads value' like vLLM."""
    return json.loads(value)


def _optional(fn: Callable[[str], Any]) -> Callable[[str], Any]:
    def _optional_type(value: str) -> Any:
        return None if value in ("", "None") else fn(value)

    _optional_type.__name__ = fn.__name__
    return _optional_type


class _BoolOpt(argparse.BooleanOptionalAction):
    """--x / --no-x, as vLLM generates for every bool config field."""


def _add_serve_args(p: argparse.ArgumentParser) -> None:
    """The `vllm serve` flags the simulator accepts: a subset of vLLM 0.23's, same names."""
    B = dict(action=_BoolOpt)
    opt_str = _optional(str)
    opt_int = _optional(int)
    opt_json = _optional(loads)

    p.add_argument("model_tag", type=str, nargs="?", help="The model tag to serve")
    p.add_argument("--headless", action="store_true", default=False)
    p.add_argument("--api-server-count", "-asc", type=int, default=None)

    fe = p.add_argument_group("Frontend")
    fe.add_argument("--host", type=opt_str, default=None)
    fe.add_argument("--port", type=int, default=8000)
    fe.add_argument("--uvicorn-log-level", type=str, default="info",
                    choices=["critical", "error", "warning", "info", "debug", "trace"])
    fe.add_argument("--disable-uvicorn-access-log", default=False, **B)
    fe.add_argument("--disable-access-log-for-endpoints", type=opt_str, default=None)
    fe.add_argument("--allow-credentials", default=False, **B)
    fe.add_argument("--allowed-origins", type=loads, default=["*"])
    fe.add_argument("--allowed-methods", type=loads, default=["*"])
    fe.add_argument("--allowed-headers", type=loads, default=["*"])
    fe.add_argument("--api-key", type=opt_str, nargs="+", default=None)
    fe.add_argument("--root-path", type=opt_str, default=None)
    fe.add_argument("--enable-request-id-headers", default=False, **B)
    fe.add_argument("--disable-fastapi-docs", default=False, **B)
    fe.add_argument("--chat-template", type=opt_str, default=None)
    fe.add_argument("--chat-template-content-format", type=str, default="auto", choices=["auto", "string", "openai"])
    fe.add_argument("--trust-request-chat-template", default=False, **B)
    fe.add_argument("--default-chat-template-kwargs", type=opt_json, default=None)
    fe.add_argument("--response-role", type=str, default="assistant")
    fe.add_argument("--return-tokens-as-token-ids", default=False, **B)
    fe.add_argument("--enable-auto-tool-choice", default=False, **B)
    fe.add_argument("--exclude-tools-when-tool-choice-none", default=False, **B)
    fe.add_argument("--tool-call-parser", type=opt_str, default=None)
    fe.add_argument("--tool-parser-plugin", type=str, default="")
    fe.add_argument("--max-log-len", type=opt_int, default=None)
    fe.add_argument("--enable-prompt-tokens-details", default=False, **B)
    fe.add_argument("--enable-server-load-tracking", default=False, **B)
    fe.add_argument("--enable-force-include-usage", default=False, **B)
    fe.add_argument("--enable-tokenizer-info-endpoint", default=False, **B)
    fe.add_argument("--enable-log-outputs", default=False, **B)
    fe.add_argument("--log-error-stack", default=False, **B)

    mc = p.add_argument_group("ModelConfig")
    mc.add_argument("--model", type=str, default=None)
    mc.add_argument("--runner", type=str, default="auto")
    mc.add_argument("--tokenizer", type=opt_str, default=None)
    mc.add_argument("--tokenizer-mode", type=str, default="auto")
    mc.add_argument("--trust-remote-code", default=False, **B)
    mc.add_argument("--dtype", type=str, default="auto",
                    choices=["auto", "half", "float16", "bfloat16", "float", "float32"])
    mc.add_argument("--seed", type=int, default=0)
    mc.add_argument("--revision", type=opt_str, default=None)
    mc.add_argument("--code-revision", type=opt_str, default=None)
    mc.add_argument("--tokenizer-revision", type=opt_str, default=None)
    mc.add_argument("--max-model-len", type=_human_int_or_auto, default=None)
    mc.add_argument("--quantization", "-q", type=opt_str, default=None)
    mc.add_argument("--enforce-eager", default=False, **B)
    mc.add_argument("--max-logprobs", type=int, default=20)
    mc.add_argument("--disable-sliding-window", default=False, **B)
    mc.add_argument("--disable-cascade-attn", default=False, **B)
    mc.add_argument("--skip-tokenizer-init", default=False, **B)
    mc.add_argument("--served-model-name", type=opt_str, nargs="+", default=None)
    mc.add_argument("--hf-token", type=str, nargs="?", const=True, default=None)
    mc.add_argument("--hf-overrides", type=loads, default=None)
    mc.add_argument("--generation-config", type=str, default="auto")
    mc.add_argument("--override-generation-config", type=loads, default=None)
    mc.add_argument("--enable-sleep-mode", default=False, **B)
    mc.add_argument("--model-impl", type=str, default="auto")

    lc = p.add_argument_group("LoadConfig")
    lc.add_argument("--load-format", type=str, default="auto")
    lc.add_argument("--download-dir", type=opt_str, default=None)
    lc.add_argument("--safetensors-load-strategy", type=opt_str, default=None)
    lc.add_argument("--model-loader-extra-config", type=loads, default=None)
    lc.add_argument("--ignore-patterns", type=str, nargs="+", default=None)

    p.add_argument_group("AttentionConfig").add_argument("--attention-backend", type=opt_str, default=None)

    so = p.add_argument_group("StructuredOutputsConfig")
    so.add_argument("--reasoning-parser", type=str, default="")
    so.add_argument("--reasoning-parser-plugin", type=str, default="")

    pc = p.add_argument_group("ParallelConfig")
    pc.add_argument("--distributed-executor-backend", type=opt_str, default=None)
    pc.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    pc.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    pc.add_argument("--data-parallel-size", "-dp", type=int, default=1)
    pc.add_argument("--enable-expert-parallel", "-ep", default=False, **B)
    pc.add_argument("--max-parallel-loading-workers", type=opt_int, default=None)
    pc.add_argument("--disable-custom-all-reduce", default=False, **B)

    cc = p.add_argument_group("CacheConfig")
    cc.add_argument("--block-size", type=opt_int, default=None)
    cc.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    cc.add_argument("--kv-cache-memory-bytes", type=_optional(_human_int), default=None)
    cc.add_argument("--kv-cache-dtype", type=str, default="auto")
    cc.add_argument("--num-gpu-blocks-override", type=opt_int, default=None)
    cc.add_argument("--enable-prefix-caching", default=None, **B)
    cc.add_argument("--prefix-caching-hash-algo", type=str, default="sha256")
    cc.add_argument("--calculate-kv-scales", default=False, **B)
    cc.add_argument("--mamba-cache-dtype", type=str, default="auto")
    cc.add_argument("--mamba-ssm-cache-dtype", type=str, default="auto")
    cc.add_argument("--mamba-block-size", type=opt_int, default=None)

    oc = p.add_argument_group("OffloadConfig")
    oc.add_argument("--cpu-offload-gb", type=float, default=0)

    mm = p.add_argument_group("MultiModalConfig")
    mm.add_argument("--language-model-only", default=False, **B)
    mm.add_argument("--limit-mm-per-prompt", type=loads, default=None)
    mm.add_argument("--mm-processor-cache-gb", type=float, default=4)
    mm.add_argument("--mm-encoder-tp-mode", type=str, default="weights")
    mm.add_argument("--skip-mm-profiling", default=False, **B)

    lo = p.add_argument_group("LoRAConfig")
    lo.add_argument("--enable-lora", action=_BoolOpt)
    lo.add_argument("--max-loras", type=int, default=1)
    lo.add_argument("--max-lora-rank", type=int, default=16)

    ob = p.add_argument_group("ObservabilityConfig")
    ob.add_argument("--show-hidden-metrics-for-version", type=opt_str, default=None)
    ob.add_argument("--otlp-traces-endpoint", type=opt_str, default=None)

    sc = p.add_argument_group("SchedulerConfig")
    sc.add_argument("--max-num-batched-tokens", type=_optional(_human_int), default=None)
    sc.add_argument("--max-num-seqs", type=opt_int, default=None)
    sc.add_argument("--max-num-partial-prefills", type=int, default=1)
    sc.add_argument("--max-long-partial-prefills", type=int, default=1)
    sc.add_argument("--long-prefill-token-threshold", type=int, default=0)
    sc.add_argument("--scheduling-policy", type=str, default="fcfs", choices=["fcfs", "priority"])
    sc.add_argument("--enable-chunked-prefill", default=None, **B)
    sc.add_argument("--disable-chunked-mm-input", default=False, **B)
    sc.add_argument("--async-scheduling", default=None, **B)
    sc.add_argument("--stream-interval", type=int, default=1)

    co = p.add_argument_group("CompilationConfig")
    co.add_argument("--cudagraph-capture-sizes", type=int, nargs="+", default=None)
    co.add_argument("--max-cudagraph-capture-size", type=opt_int, default=None)

    kc = p.add_argument_group("KernelConfig")
    kc.add_argument("--moe-backend", type=lambda s: s.lower().replace("-", "_"), default="auto")

    vc = p.add_argument_group("VllmConfig")
    vc.add_argument("--speculative-config", "-sc", type=opt_json, default=None)
    vc.add_argument("--spec-method", type=opt_str, default=None)
    vc.add_argument("--spec-model", type=opt_str, default=None)
    vc.add_argument("--spec-tokens", type=opt_int, default=None)
    vc.add_argument("--kv-transfer-config", type=opt_json, default=None)
    vc.add_argument("--compilation-config", "-cc", type=loads, default=None)
    vc.add_argument("--attention-config", "-ac", type=loads, default=None)
    vc.add_argument("--additional-config", type=loads, default=None)
    vc.add_argument("--optimization-level", type=str, default="2")
    vc.add_argument("--performance-mode", type=str, default="balanced")

    p.add_argument("--disable-log-stats", action="store_true", help="Disable logging statistics.")
    p.add_argument("--shutdown-timeout", type=int, default=0)
    p.add_argument("--enable-log-requests", action=_BoolOpt, default=False)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm", description="vLLM CLI")
    parser.add_argument("-v", "--version", action="version", version=VERSION)
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = subparsers.add_parser(
        "serve", help="Launch a local OpenAI-compatible API server to serve LLM completions via HTTP.",
        usage="vllm serve [model_tag] [options]",
    )
    _add_serve_args(serve)
    return parser


def serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    for action in parser._actions:  # noqa: SLF001 - argparse has no public accessor
        if isinstance(action, argparse._SubParsersAction):  # noqa: SLF001
            return action.choices["serve"]
    raise AssertionError("no serve subcommand")


def serve_long_flags() -> set[str]:
    """Every ``--flag`` spelling `vllm serve` accepts here (incl. ``--no-`` forms)."""
    return {s for a in serve_parser()._actions for s in a.option_strings if s.startswith("--") and s != "--help"}  # noqa: SLF001


def serve_short_flags() -> set[str]:
    return {s for a in serve_parser()._actions for s in a.option_strings  # noqa: SLF001
            if s.startswith("-") and not s.startswith("--") and s != "-h"}


def normalize_argv(argv: list[str]) -> list[str]:
    """FlexibleArgumentParser's rewrites: ``serve --model M`` → ``serve M``, ``--a_b`` →
    ``--a-b``, ``-O3`` → ``--optimization-level 3``, ``--x.k v`` merged into ``--x JSON``."""
    args = list(argv)
    if args and args[0] == "serve":
        for i, a in enumerate(args):
            if a == "--model" and i + 1 < len(args):
                log("WARNING", "argparse_utils.py:260", "With `vllm serve`, you should provide the model as a "
                    "positional argument or in a config file instead of via the `--model` option.")
                args = ["serve", args[i + 1], *args[1:i], *args[i + 2:]]
                break
            if a.startswith("--model="):
                args = ["serve", a.removeprefix("--model="), *args[1:i], *args[i + 1:]]
                break
    out: list[str] = []
    for i, a in enumerate(args):
        if a.startswith("--"):
            key, eq, value = a.partition("=")
            head, dot, rest = key[2:].partition(".")
            out.append("--" + head.replace("_", "-") + dot + rest + eq + value)
        elif a.startswith("-O") and a != "-O":
            out += ["--optimization-level", a[3:] if a[2:3] == "=" else a[2:]]
        elif a == "-O" and i + 1 < len(args) and args[i + 1] in {"0", "1", "2", "3"}:
            out.append("--optimization-level")
        else:
            out.append(a)
    # Dotted JSON arguments: --speculative-config.method dflash → {"method": "dflash"}.
    merged: dict[str, dict[str, Any]] = {}
    final: list[str] = []
    skip = False
    for i, a in enumerate(out):
        if skip:
            skip = False
            continue
        if a.startswith("--") and "." in a.split("=", 1)[0]:
            key, eq, value = a.partition("=")
            if not eq:
                value = out[i + 1] if i + 1 < len(out) else ""
                skip = True
            name, *path = key.split(".")
            if path and path[-1].endswith("+"):
                path[-1] = path[-1][:-1]
                parsed: Any = value.split(",")
            else:
                try:
                    parsed = json.loads(value)
                except json.JSONDecodeError:
                    parsed = value
            node = merged.setdefault(name, {})
            for p in path[:-1]:
                node = node.setdefault(p, {})
            node[path[-1]] = parsed
            continue
        final.append(a)
    for name, value in merged.items():
        final += [name, json.dumps(value)]
    return final


# --------------------------------------------------------------------------------------
# Speculative config
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SpecConfig:
    method: str  # as given (qwen3_5_mtp stays visible in logs; behaves as mtp)
    num_speculative_tokens: int
    model: str | None
    revision: str | None

    @property
    def is_mtp(self) -> bool:
        return self.method in MTP_METHODS


def _validation_error(field_name: str, message: str, value: Any) -> StartupError:
    return StartupError(
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for SpeculativeConfig\n"
        f"{field_name}\n  {message} [input_value={value!r}, input_type={type(value).__name__}]"
    )


def parse_speculative_config(raw: Any) -> SpecConfig | None:
    """Validate ``--speculative-config`` the way vLLM's SpeculativeConfig does."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise _validation_error("speculative_config", "Input should be a valid dictionary or instance of "
                                "SpeculativeConfig", raw)
    for key in raw:
        if key not in SPEC_CONFIG_KEYS:
            raise _validation_error(key, "Extra inputs are not permitted", raw[key])
    method = raw.get("method")
    model = raw.get("model")
    if method is None:
        if model is None:
            raise StartupError("ValueError: num_speculative_tokens was provided but without speculative model.")
        method = "ngram" if model in ("ngram", "[ngram]") else "draft_model"
    if method not in SPEC_METHODS:
        allowed = ", ".join(f"'{m}'" for m in sorted(SPEC_METHODS))
        raise _validation_error("method", f"Input should be {allowed}", method)
    n = raw.get("num_speculative_tokens")
    if n is None:
        raise StartupError("ValueError: num_speculative_tokens must be provided with speculative model unless "
                           "the draft model config contains an n_predict parameter.")
    if isinstance(n, bool) or not isinstance(n, int):
        raise _validation_error("num_speculative_tokens", "Input should be a valid integer", n)
    if n <= 0:
        raise _validation_error("num_speculative_tokens", "Input should be greater than 0", n)
    if model is None and method not in _SPEC_METHODS_WITHOUT_MODEL:
        raise StartupError("ValueError: num_speculative_tokens was provided but without speculative model.")
    if model is not None and not isinstance(model, str):
        raise _validation_error("model", "Input should be a valid string", model)
    if method in MTP_METHODS and method != "mtp":
        log("WARNING", "speculative.py:551", f"method `{method}` is deprecated and replaced with mtp.")
    return SpecConfig(method=method, num_speculative_tokens=n, model=model, revision=raw.get("revision"))


# --------------------------------------------------------------------------------------
# Model resolution (local HF cache only)
# --------------------------------------------------------------------------------------
_SHA_RE = re.compile(r"^[0-9a-f]{40}$")
_REPO_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def hub_cache_dir(env: dict[str, str]) -> Path:
    if env.get("HF_HUB_CACHE"):
        return Path(env["HF_HUB_CACHE"])
    if env.get("HF_HOME"):
        return Path(env["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def resolve_model(model: str, revision: str | None, env: dict[str, str], what: str = "model") -> Path:
    """Local directory of ``model``: the path itself or its cached HF snapshot."""
    path = Path(model)
    if path.is_dir():
        snapshot = path
    elif _REPO_RE.match(model) and not model.startswith((".", "/")):
        cache = hub_cache_dir(env)
        folder = cache / f"models--{model.replace('/', '--')}"
        rev = revision or "main"
        if _SHA_RE.match(rev):
            sha = rev
        else:
            ref = folder / "refs" / rev
            if not ref.is_file():
                raise StartupError(
                    f"OSError: {what} {model} (revision {rev}) is not in the Hugging Face cache at {cache} "
                    f"(no {ref}). The simulated engine never downloads: fetch it first "
                    f"(HF_HUB_OFFLINE={env.get('HF_HUB_OFFLINE', '')!r})."
                )
            sha = ref.read_text().strip()
        snapshot = folder / "snapshots" / sha
        if not snapshot.is_dir():
            raise StartupError(
                f"OSError: {what} {model} revision {sha} is not in the Hugging Face cache at {cache} "
                f"(no {snapshot}). The simulated engine never downloads: fetch it first."
            )
    else:
        raise StartupError(
            f"ValueError: Invalid repository ID or local directory specified: '{model}'.\n"
            "Please verify the following requirements:\n"
            "1. Provide a valid Hugging Face repository ID.\n"
            "2. Specify a local directory that contains a recognized configuration file."
        )
    if not (snapshot / "config.json").is_file():
        raise StartupError(f"ValueError: No supported config format found in {model} ({snapshot} has no config.json)")
    _check_weights(model, snapshot)
    return snapshot


def _check_weights(model: str, snapshot: Path) -> None:
    index = snapshot / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as exc:
            raise StartupError(f"ValueError: corrupt {index}: {exc}") from exc
        for shard in sorted(set(weight_map.values())):
            if not (snapshot / shard).is_file():
                raise StartupError(f"FileNotFoundError: {model}: weight shard {shard} is missing from {snapshot}")
    elif not any(snapshot.glob("*.safetensors")) and not any(snapshot.glob("*.bin")):
        raise StartupError(f"RuntimeError: Cannot find any model weights with `{model}`")


def read_config(snapshot: Path) -> dict[str, Any]:
    try:
        return json.loads((snapshot / "config.json").read_text())
    except ValueError as exc:
        raise StartupError(f"ValueError: invalid config.json in {snapshot}: {exc}") from exc


def derived_max_model_len(config: dict[str, Any]) -> int:
    for cfg in (config.get("text_config") or {}, config):
        value = cfg.get("max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return 262144


# --------------------------------------------------------------------------------------
# Simulated performance profile
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SimProfile:
    decode_tok_s: float
    ttft_s: float
    accept_len: float  # mean tokens per decode step (1 = no speculation)
    ready_delay_s: float
    num_speculative_tokens: int  # 0 = no speculation
    label: str


def _env_float(env: dict[str, str], name: str, default: float, minimum: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise StartupError(f"ValueError: {name}={raw!r} is not a number") from exc
    if not value >= minimum:
        raise StartupError(f"ValueError: {name}={raw!r} must be >= {minimum}")
    return value


def sim_profile(model: str, config: dict[str, Any], spec: SpecConfig | None, env: dict[str, str]) -> SimProfile:
    """Defaults per profile from the seeds' numbers; SIM_* env overrides them."""
    hybrid = "fp8-hybrid" in model.lower() or bool(config.get("sparkfleet_hybrid"))
    if spec is None:
        rate, accept, label = (HYBRID_DECODE_TOK_S, 1.0, "hybrid") if hybrid else (BASE_DECODE_TOK_S, 1.0, "base")
    elif spec.method == "dflash":
        rate, accept, label = DFLASH_DECODE_TOK_S, DFLASH_ACCEPT, "dflash"
    elif spec.is_mtp:
        rate, accept, label = MTP_DECODE_TOK_S, MTP_ACCEPT, "mtp"
    else:
        rate, accept, label = OTHER_SPEC_DECODE_TOK_S, OTHER_SPEC_ACCEPT, spec.method
    k = spec.num_speculative_tokens if spec else 0
    accept = _env_float(env, "SIM_ACCEPT_LEN", accept, 1.0) if spec else 1.0
    if accept > k + 1:
        log("WARNING", "sim", f"SIM_ACCEPT_LEN {accept} exceeds num_speculative_tokens + 1 = {k + 1}; capped")
        accept = float(k + 1)
    return SimProfile(
        decode_tok_s=_env_float(env, "SIM_DECODE_TOK_S", rate, 1e-3),
        ttft_s=_env_float(env, "SIM_TTFT_S", DEFAULT_TTFT_S, 0.0),
        accept_len=accept,
        ready_delay_s=_env_float(env, "SIM_READY_DELAY_S", DEFAULT_READY_DELAY_S, 0.0),
        num_speculative_tokens=k,
        label=label,
    )


def decode_blocks(n_tokens: int, accept_len: float, k: int, steps: int | None = None) -> list[int]:
    """Sizes of the token groups a request's output arrives in.

    The first token comes alone (it is the prefill's output). The other ``n - 1`` come
    one per decode step, or under speculative decoding in ``steps`` near-equal accepted
    blocks (default: the nearest to ``(n - 1) / accept_len``), none above ``k + 1``."""
    if n_tokens <= 0:
        return []
    rest = n_tokens - 1
    if rest == 0:
        return [1]
    if k <= 0:
        return [1] * n_tokens
    if steps is None:
        steps = round(rest / accept_len)
    steps = min(max(steps, math.ceil(rest / (k + 1)), 1), rest)
    return [1] + [(i + 1) * rest // steps - i * rest // steps for i in range(steps)]


class StepPlanner:
    """Chooses each request's number of decode steps so that the engine's acceptance
    length tracks the set value across requests, short ones included (alone, a 30-token
    request can only be 29/3 or 29/4 tokens per step).

    The rounding residue is carried to the next request, so one request is within one
    step of ``(n - 1) / accept_len`` and the running total within half a step. Steps
    forced by the limits (at least one, at most k + 1 tokens each) are not carried."""

    def __init__(self, accept_len: float, k: int) -> None:
        self.accept_len, self.k = accept_len, k
        self._carry = 0.0
        self._lock = threading.Lock()

    def blocks(self, n_tokens: int) -> list[int]:
        if self.k <= 0 or n_tokens <= 1:
            return decode_blocks(n_tokens, self.accept_len, self.k)
        rest = n_tokens - 1
        with self._lock:
            wanted = rest / self.accept_len + self._carry
            blocks = decode_blocks(n_tokens, self.accept_len, self.k, steps=round(wanted))
            steps = len(blocks) - 1
            if steps == round(wanted):
                self._carry = wanted - steps
        return blocks


# --------------------------------------------------------------------------------------
# Deterministic text
# --------------------------------------------------------------------------------------
_WORDS = (
    "the history of tea begins in southwest China where leaves were first brewed as a medicinal drink "
    "during the Shang dynasty and later spread along trade routes to Japan Korea India and Europe "
    "merchants carried compressed bricks across mountains while monks cultivated gardens near temples "
    "ceremonies developed around preparation and serving and each region shaped its own customs flavor "
    "and meaning over many centuries of careful practice patient growth and quiet exchange between "
    "cultures cities and families who gathered around warm cups to share stories news and ideas"
).split()
_CODE = (
    "def", " process", "_items", "(", "items", ")", ":", "\n", "    ", "total", " =", " 0", "\n", "    ",
    "for", " item", " in", " items", ":", "\n", "        ", "if", " item", " >", " 0", ":", "\n",
    "            ", "total", " +=", " item", "\n", "    ", "return", " total", "\n", "\n",
)
_REASONING = (" Okay", ",", " the", " user", " asks", " a", " question", ".", " Let", " me", " think",
              " it", " through", " step", " by", " step", ".")
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    return len(_TOKEN_RE.findall(text))


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


def _prose(rng: random.Random) -> Iterator[str]:
    while True:
        length = rng.randint(8, 18)
        for i in range(length):
            word = rng.choice(_WORDS)
            yield " " + (word.capitalize() if i == 0 else word)
        yield "."


def _answer(topic_text: str, seed_text: str) -> tuple[list[str], Iterator[str]]:
    """(natural answer ending at EOS, what follows if EOS is ignored)."""
    rng = random.Random(_seed(seed_text))
    low = topic_text.lower()
    filler = _prose(random.Random(_seed("filler:" + seed_text)))
    if "capital of france" in low:
        return ["Paris", "."], filler
    if re.search(r"\bcount", low):
        m = re.search(r"\bto (\d+)", low)
        top = min(int(m.group(1)), 10000) if m else 100
        return [f" {i}" for i in range(1, top + 1)], filler
    if "json" in low:
        pieces: list[str] = ["{"]
        for i in range(rng.randint(6, 12)):
            pieces += ['"', f"field_{i}", '":', ' "', rng.choice(_WORDS), '"', ","]
        pieces[-1] = "}"
        return pieces, filler
    if re.search(r"\b(code|function|python|program|script|implement)\b", low):
        return list(_CODE) * rng.randint(2, 4), filler
    prose = _prose(rng)
    return [next(prose) for _ in range(rng.randint(40, 120))], filler


@dataclass
class Piece:
    kind: str  # "content" | "reasoning" | "tool_name" | "tool_args"
    text: str


@dataclass
class Plan:
    """What one request will produce, token by token."""
    n_tokens: int
    finish_reason: str
    pieces: Iterator[Piece]
    tool_call: dict[str, Any] | None = None  # {"id", "name"}


def plan_output(answer: list[Piece], filler: Iterator[str], limit: int, min_tokens: int,
                ignore_eos: bool) -> tuple[int, str, Iterator[Piece]]:
    """Apply max_tokens (limit), min_tokens and ignore_eos to a natural answer."""
    natural = len(answer)
    if ignore_eos:
        n, reason = limit, "length"
    else:
        stop_at = max(natural, min_tokens)
        # Reaching max_tokens is "length" even if EOS would have come next.
        n, reason = (stop_at, "stop") if stop_at < limit else (limit, "length")

    def gen() -> Iterator[Piece]:
        for i, piece in enumerate(answer):
            if i >= n:
                return
            yield piece
        for _ in range(n - natural):
            yield Piece("content", next(filler))

    return n, reason, gen()


# --------------------------------------------------------------------------------------
# Metrics (Prometheus text, vLLM names and labels)
# --------------------------------------------------------------------------------------
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


def _fmt(value: float) -> str:
    return repr(float(value))


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self, model_name: str, num_spec_tokens: int) -> None:
        self.labels = f'engine="0",model_name="{_label_value(model_name)}"'
        self.k = num_spec_tokens
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0] * num_spec_tokens

    def decode_step(self, block: int) -> None:
        """One verification step that yielded ``block`` tokens (block - 1 accepted)."""
        with self.lock:
            self.generation_tokens += block
            if self.k:
                accepted = block - 1
                self.drafts += 1
                self.draft_tokens += self.k
                self.accepted += accepted
                for pos in range(accepted):
                    self.accepted_per_pos[pos] += 1

    def render(self) -> str:
        lb = self.labels
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"{name}{suffix}{{{labels}}} {_fmt(value)}")

        def histogram(name: str, doc: str, h: _Histogram) -> None:
            samples = [("_bucket", f'{lb},le="{b}"', c) for b, c in zip(h.buckets, h.counts)]
            samples += [("_bucket", f'{lb},le="+Inf"', h.n), ("_count", lb, h.n), ("_sum", lb, h.total)]
            metric(name, "histogram", doc, samples)

        with self.lock:
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [("", lb, self.running)])
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [("", lb, self.waiting)])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   [("", lb, min(1.0, 0.01 * self.running))])
            metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                   [("", lb, self.prompt_tokens)])
            metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                   [("", lb, self.generation_tokens)])
            metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                   [("", f'{lb},finished_reason="{r}"', c) for r, c in self.success.items()])
            histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft)
            histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e)
            if self.k:
                metric("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.",
                       [("", lb, self.drafts)])
                metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
                       [("", lb, self.draft_tokens)])
                metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
                       [("", lb, self.accepted)])
                metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                       "Accepted tokens per draft position.",
                       [("", f'{lb},position="{p}"', c) for p, c in enumerate(self.accepted_per_pos)])
        return "\n".join(out) + "\n"


# --------------------------------------------------------------------------------------
# The engine: request → timed token blocks
# --------------------------------------------------------------------------------------
class ClientGone(Exception):
    """The client closed the stream; the request is aborted."""


@dataclass
class Engine:
    served_names: list[str]
    model: str
    snapshot: Path
    max_model_len: int
    profile: SimProfile
    api_keys: list[str]
    enable_auto_tools: bool
    tool_parser: str | None
    reasoning_parser: str | None
    max_num_seqs: int
    access_log: bool
    metrics: Metrics = field(init=False)
    planner: StepPlanner = field(init=False)
    slots: threading.BoundedSemaphore = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.served_names[0], self.profile.num_speculative_tokens)
        self.planner = StepPlanner(self.profile.accept_len, self.profile.num_speculative_tokens)
        self.slots = threading.BoundedSemaphore(self.max_num_seqs)

    def run(self, prompt_tokens: int, plan: Plan, emit: Callable[[list[Piece]], None]) -> int:
        """Produce ``plan`` on the simulated clock, calling ``emit`` per token block.

        Returns the number of tokens produced (less than planned if the client left)."""
        m, prof = self.metrics, self.profile
        with m.lock:
            m.waiting += 1
        self.slots.acquire()
        with m.lock:
            m.waiting -= 1
            m.running += 1
        t0 = time.monotonic()
        produced = 0
        outcome = "abort"
        try:
            blocks = self.planner.blocks(plan.n_tokens)
            t_first = t0 + prof.ttft_s
            with m.lock:
                m.prompt_tokens += prompt_tokens
            for i, size in enumerate(blocks):
                # Absolute schedule: token j (0-based) is due at t_first + j / rate.
                _sleep_until(t_first + (produced + size - 1) / prof.decode_tok_s)
                pieces = [next(plan.pieces) for _ in range(size)]
                if i == 0:
                    with m.lock:
                        m.ttft.observe(time.monotonic() - t0)
                        m.generation_tokens += size
                else:
                    m.decode_step(size)
                produced += size
                emit(pieces)
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


# --------------------------------------------------------------------------------------
# OpenAI-compatible HTTP API
# --------------------------------------------------------------------------------------
class ApiError(Exception):
    def __init__(self, status: int, message: str, err_type: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.err_type, self.param = status, message, err_type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.status}}


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)


def _int_param(body: dict[str, Any], *names: str) -> int | None:
    for name in names:
        value = body.get(name)
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ApiError(400, f"{name} must be a non-negative integer, got {value!r}", param=name)
            return value
    return None


def _example_value(schema: dict[str, Any], name: str) -> Any:
    kind = schema.get("type")
    if "enum" in schema and schema["enum"]:
        return schema["enum"][0]
    if kind in ("integer", "number"):
        return 1
    if kind == "boolean":
        return True
    if kind == "array":
        return []
    if kind == "object":
        return {}
    return "Paris" if "city" in name or "location" in name else f"{name}_value"


class _EngineHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, addr: tuple[str, int], engine: Engine) -> None:
        self.engine = engine
        super().__init__(addr, _Handler)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _EngineHTTPServer
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
            with _LOG_LOCK:
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

    def _plain(self, status: int, text: str, content_type: str = "text/plain; charset=utf-8") -> None:
        body = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _authorized(self) -> bool:
        keys = self.server.engine.api_keys
        if not keys:
            return True
        scheme, _, token = (self.headers.get("Authorization") or "").partition(" ")
        return scheme.lower() == "bearer" and any(
            hashlib.sha256(token.encode()).digest() == hashlib.sha256(k.encode()).digest() for k in keys)

    def _route(self, method: str) -> None:
        path = self.path.split("?", 1)[0]
        body_bytes = b""
        if method == "POST":
            length = int(self.headers.get("Content-Length") or 0)
            body_bytes = self.rfile.read(length) if length else b""
        if path.startswith(("/v1", "/v2", "/inference", "/_sim")) and not self._authorized():
            return self._json(401, {"error": "Unauthorized"})
        routes: dict[tuple[str, str], Callable[..., None]] = {
            ("GET", "/health"): lambda: self._plain(200, "", "application/json"),
            ("GET", "/ping"): lambda: self._plain(200, "", "application/json"),
            ("GET", "/version"): lambda: self._json(200, {"version": VERSION}),
            ("GET", "/metrics"): lambda: self._plain(
                200, self.server.engine.metrics.render(), "text/plain; version=0.0.4; charset=utf-8"),
            ("GET", "/v1/models"): self._models,
            ("POST", "/v1/completions"): lambda: self._generate(body_bytes, chat=False),
            ("POST", "/v1/chat/completions"): lambda: self._generate(body_bytes, chat=True),
            ("POST", "/_sim/crash"): self._crash,
        }
        handler = routes.get((method, path))
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
        model = body.get("model") or eng.served_names[0]
        if model not in eng.served_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

        plan_parts = self._chat_request(body) if chat else self._completion_request(body)
        prompt_tokens, answer, filler, tool_call = plan_parts
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
        n, reason, pieces = plan_output(answer, filler, limit, min_tokens, bool(body.get("ignore_eos")))
        if tool_call is not None and reason == "stop":
            reason = "tool_calls"
        plan = Plan(n_tokens=n, finish_reason=reason, pieces=pieces, tool_call=tool_call)
        stream_opts = body.get("stream_options") or {}
        if body.get("stream"):
            self._stream(chat, model, prompt_tokens, plan, bool(stream_opts.get("include_usage")),
                         bool(stream_opts.get("continuous_usage_stats")))
        else:
            self._complete(chat, model, prompt_tokens, plan)

    def _completion_request(self, body: dict[str, Any]) -> tuple[int, list[Piece], Iterator[str], None]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            text, prompt_tokens = " ".join(map(str, prompt)), len(prompt)
        else:
            if isinstance(prompt, list):
                prompt = prompt[0] if prompt else None
            if not isinstance(prompt, str):
                raise ApiError(400, "Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
            text, prompt_tokens = prompt, max(1, count_tokens(prompt))
        natural, filler = _answer(text, text)
        return prompt_tokens, [Piece("content", t) for t in natural], filler, None

    def _chat_request(self, body: dict[str, Any]) -> tuple[int, list[Piece], Iterator[str], dict[str, Any] | None]:
        eng = self.server.engine
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise ApiError(400, "messages must be a non-empty list of message objects", param="messages")
        texts = [_text_of(m.get("content")) for m in messages]
        for m in messages:
            for tc in m.get("tool_calls") or []:
                texts.append(json.dumps(tc.get("function", {})))
        tools = body.get("tools") or []
        tool_choice = body.get("tool_choice", "auto" if tools else "none")
        if tools and tool_choice not in (None, "none"):
            if tool_choice == "auto" and not (eng.enable_auto_tools and eng.tool_parser):
                raise ApiError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                                    "to be set")
        prompt_tokens = sum(count_tokens(t) for t in texts) + 4 * len(messages) + 3
        if tools:
            prompt_tokens += count_tokens(json.dumps(tools))
        last_user = next((_text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
        seed_text = json.dumps(messages, sort_keys=True, default=str)
        natural, filler = _answer(last_user, seed_text)
        answer = [Piece("content", t) for t in natural]

        tool_call = None
        function = self._pick_tool(tools, tool_choice, messages[-1], last_user)
        if function is not None:
            params = function.get("parameters") or {}
            props = params.get("properties") or {}
            wanted = params.get("required") or list(props)[:1]
            args = json.dumps({name: _example_value(props.get(name, {}), name) for name in wanted})
            tool_call = {"id": f"chatcmpl-tool-{uuid.uuid4().hex[:16]}", "name": function.get("name", "tool")}
            answer = [Piece("tool_args", t) for t in re.findall(r"\w+|\s+|[^\w\s]", args)]

        kwargs = {**(body.get("chat_template_kwargs") or {})}
        if eng.reasoning_parser and kwargs.get("enable_thinking") is True:
            # Thinking is opt-in here so plain smoke/bench traffic gets plain content.
            think = [Piece("reasoning", _REASONING[i % len(_REASONING)]) for i in range(len(_REASONING))]
            answer = think + answer
        return max(1, prompt_tokens), answer, filler, tool_call

    @staticmethod
    def _pick_tool(tools: list[Any], tool_choice: Any, last: dict[str, Any], last_user: str) -> dict[str, Any] | None:
        functions = [t.get("function", {}) for t in tools if isinstance(t, dict)]
        if not functions or tool_choice in (None, "none"):
            return None
        if isinstance(tool_choice, dict):
            name = (tool_choice.get("function") or {}).get("name")
            return next((f for f in functions if f.get("name") == name), functions[0])
        if tool_choice == "required":
            return functions[0]
        if last.get("role") != "user":
            return None  # after a tool result the simulated model answers in prose
        low = last_user.lower()
        for f in functions:
            name = str(f.get("name", ""))
            if name and (name.lower() in low or name.lower().replace("_", " ") in low):
                return f
        return functions[0] if re.search(r"\b(tool|function)\b", low) else None

    def _usage(self, prompt_tokens: int, n: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + n, "completion_tokens": n,
                "prompt_tokens_details": None}

    def _complete(self, chat: bool, model: str, prompt_tokens: int, plan: Plan) -> None:
        parts: dict[str, list[str]] = {"content": [], "reasoning": [], "tool_args": []}
        produced = self.server.engine.run(
            prompt_tokens, plan, lambda pieces: [parts[p.kind].append(p.text) for p in pieces])
        created = int(time.time())
        usage = self._usage(prompt_tokens, produced)
        if not chat:
            self._json(200, {
                "id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": "".join(parts["content"]), "logprobs": None,
                             "finish_reason": plan.finish_reason, "stop_reason": None, "prompt_logprobs": None}],
                "usage": usage, "system_fingerprint": None, "kv_transfer_params": None,
            })
            return
        tool_calls = []
        if plan.tool_call is not None:
            tool_calls = [{"id": plan.tool_call["id"], "type": "function",
                           "function": {"name": plan.tool_call["name"], "arguments": "".join(parts["tool_args"])}}]
        content = "".join(parts["content"])
        message = {"role": "assistant", "content": content if (content or not tool_calls) else None,
                   "refusal": None, "annotations": None, "audio": None, "function_call": None,
                   "tool_calls": tool_calls, "reasoning": "".join(parts["reasoning"]) or None}
        self._json(200, {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": plan.finish_reason,
                         "stop_reason": None, "token_ids": None}],
            "service_tier": None, "system_fingerprint": None, "usage": usage, "prompt_logprobs": None,
            "prompt_token_ids": None, "kv_transfer_params": None,
        })

    def _stream(self, chat: bool, model: str, prompt_tokens: int, plan: Plan, include_usage: bool,
                continuous_usage: bool) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream; charset=utf-8")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache")
        self.end_headers()
        rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
        obj = "chat.completion.chunk" if chat else "text_completion"
        created = int(time.time())
        state = {"produced": 0, "first": True, "tool_started": False}

        def send(data: str) -> None:
            payload = f"data: {data}\n\n".encode()
            try:
                self.wfile.write(f"{len(payload):X}\r\n".encode() + payload + b"\r\n")
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise ClientGone() from exc

        def chunk(choice: dict[str, Any]) -> None:
            msg: dict[str, Any] = {"id": rid, "object": obj, "created": created, "model": model, "choices": [choice]}
            if include_usage and continuous_usage:
                msg["usage"] = self._usage(prompt_tokens, state["produced"])
            send(json.dumps(msg))

        def emit(pieces: list[Piece]) -> None:
            state["produced"] += len(pieces)
            last = state["produced"] >= plan.n_tokens
            finish = plan.finish_reason if last else None
            if not chat:
                chunk({"index": 0, "text": "".join(p.text for p in pieces), "logprobs": None,
                       "finish_reason": finish, "stop_reason": None})
                return
            if state["first"]:
                state["first"] = False
                chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})
            delta: dict[str, Any] = {}
            for kind in ("reasoning", "content"):
                text = "".join(p.text for p in pieces if p.kind == kind)
                if text:
                    delta[kind] = text
            args = "".join(p.text for p in pieces if p.kind == "tool_args")
            if args and plan.tool_call is not None:
                call: dict[str, Any] = {"index": 0, "function": {"arguments": args}}
                if not state["tool_started"]:
                    state["tool_started"] = True
                    call = {"id": plan.tool_call["id"], "type": "function", "index": 0,
                            "function": {"name": plan.tool_call["name"], "arguments": args}}
                delta["tool_calls"] = [call]
            chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})

        try:
            produced = self.server.engine.run(prompt_tokens, plan, emit)
            if include_usage:
                send(json.dumps({"id": rid, "object": obj, "created": created, "model": model, "choices": [],
                                 "usage": self._usage(prompt_tokens, produced)}))
            send("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
        except (ClientGone, BrokenPipeError, ConnectionResetError):
            self.close_connection = True


# --------------------------------------------------------------------------------------
# Startup
# --------------------------------------------------------------------------------------
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
            if self.engine.profile.num_speculative_tokens and d[2]:
                log("INFO", "metrics.py:100", f"SpecDecoding metrics: Mean acceptance length: {1 + d[3] / d[2]:.2f}, "
                    f"Accepted throughput: {d[3] / self.interval:.2f} tokens/s, Drafted throughput: "
                    f"{d[4] / self.interval:.2f} tokens/s, Accepted: {d[3]} tokens, Drafted: {d[4]} tokens, "
                    f"Avg Draft acceptance rate: {100.0 * d[3] / max(1, d[4]):.1f}%")


def build_engine(args: argparse.Namespace, env: dict[str, str]) -> Engine:
    """Everything vLLM checks before it binds: parsers, spec config, model, drafter."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise StartupError("TypeError: Error: --enable-auto-tool-choice requires --tool-call-parser")
    if args.tool_call_parser and args.tool_call_parser not in TOOL_PARSERS:
        raise StartupError(f"KeyError: 'invalid tool call parser: {args.tool_call_parser} "
                           f"(chose from {{ {','.join(sorted(TOOL_PARSERS))} }})'")
    if args.reasoning_parser and args.reasoning_parser not in REASONING_PARSERS:
        raise StartupError(f"KeyError: 'invalid reasoning parser: {args.reasoning_parser} "
                           f"(chose from {{ {','.join(sorted(REASONING_PARSERS))} }})'")
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
    profile = sim_profile(model, config, spec, env)
    served = args.served_model_name or [model]
    api_keys = [k for k in (args.api_key or [env.get("VLLM_API_KEY", "")]) if k]
    return Engine(
        served_names=served, model=model, snapshot=snapshot, max_model_len=max_len, profile=profile,
        api_keys=api_keys, enable_auto_tools=bool(args.enable_auto_tool_choice), tool_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser or None, max_num_seqs=args.max_num_seqs or 256,
        access_log=not args.disable_uvicorn_access_log,
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
    prof = engine.profile
    log("INFO", "sim", f"SIMULATED engine ({prof.label}): decode {prof.decode_tok_s:g} tok/s, TTFT {prof.ttft_s:g} s, "
        f"acceptance length {prof.accept_len:g}, ready after {prof.ready_delay_s:g} s")
    log("INFO", "gpu_model_runner.py:2602", f"Starting to load model {engine.snapshot}...")
    if stop.wait(prof.ready_delay_s):
        log("INFO", "launcher.py:110", "Shutting down before startup completed.")
        return 0
    log("INFO", "gpu_model_runner.py:2634", f"Model loading took {61.5 if prof.label != 'hybrid' else 63.1} GiB "
        f"memory and {prof.ready_delay_s:.2f} seconds")
    host = args.host if args.host is not None else "0.0.0.0"
    try:
        httpd = _EngineHTTPServer((host, args.port), engine)
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
    with _LOG_LOCK:
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
    args = parser.parse_args(normalize_argv(argv))  # exits 2 on an unknown flag
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


if __name__ == "__main__":
    sys.exit(main())
