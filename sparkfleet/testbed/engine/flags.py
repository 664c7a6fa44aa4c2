"""The ``vllm serve`` command line, as vLLM 0.23 spells it: names, flags, argv rewrites,
and the speculative config's validation.

``tests/testbed/test_engine_flags.py`` checks every accepted flag and every name below
against the real vLLM 0.23 source.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .logs import StartupError, log

VERSION = "0.23.0"
#: The NCCL the 0.23 image's torch bundles; the deploy's in-image check reads it here
#: (runtime/vllm_cli.py ``image_nccl``), a real image's from ``torch.cuda.nccl.version()``.
NCCL_VERSION = "2.27.7"

# --------------------------------------------------------------------------------------
# Names vLLM 0.23 knows
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
    # An import path per flag; vLLM mounts each in front of its own middlewares.
    fe.add_argument("--middleware", type=str, action="append", default=[])

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
    pc.add_argument("--master-addr", type=str, default="127.0.0.1")  # multinode.py: the multi-node flags
    pc.add_argument("--master-port", type=int, default=29501)
    pc.add_argument("--nnodes", "-n", type=int, default=1)
    pc.add_argument("--node-rank", "-r", type=int, default=0)
    pc.add_argument("--distributed-timeout-seconds", type=opt_int, default=None)
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


class FlexibleArgumentParser(argparse.ArgumentParser):
    """vllm.utils.argparse_utils.FlexibleArgumentParser: argparse with vLLM's argv
    rewrites (``normalize_argv``) before parsing."""

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        return super().parse_args(normalize_argv(list(sys.argv[1:] if args is None else args)), namespace)


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """vllm.entrypoints.openai.cli_args.make_arg_parser: every `vllm serve` flag on ``parser``."""
    _add_serve_args(parser)
    return parser


def validate_parsed_serve_args(args: argparse.Namespace) -> None:
    """vllm.entrypoints.openai.cli_args.validate_parsed_serve_args: checks before loading."""
    if getattr(args, "subparser", "serve") != "serve":
        return
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise TypeError("Error: --enable-auto-tool-choice requires --tool-call-parser")
    if args.enable_log_outputs and not args.enable_log_requests:
        raise TypeError("Error: --enable-log-outputs requires --enable-log-requests")


class ToolParserManager:
    """vllm.tool_parsers.ToolParserManager, as far as names go."""

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(TOOL_PARSERS)


class ReasoningParserManager:
    """vllm.reasoning.ReasoningParserManager, as far as names go."""

    @classmethod
    def list_registered(cls) -> list[str]:
        return sorted(REASONING_PARSERS)


def build_parser() -> argparse.ArgumentParser:
    """`vllm`'s parser as vllm/entrypoints/cli/main.py builds it, with the serve subcommand."""
    parser = FlexibleArgumentParser(prog="vllm", description="vLLM CLI")
    parser.add_argument("-v", "--version", action="version", version=VERSION)
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    make_arg_parser(subparsers.add_parser(
        "serve", help="Launch a local OpenAI-compatible API server to serve LLM completions via HTTP.",
        usage="vllm serve [model_tag] [options]",
    ))
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


