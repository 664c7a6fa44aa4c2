"""serve.env -> ``vllm serve`` argv: the ONE place the serving command is built.

``SERVE_ENV`` is the serve.env contract as data: each variable's setting, how its value
maps to text, and what the wrapper makes of it. The deploy renders serve.env from it
(``Settings.serve_env``), docs/architecture.md's table is generated from it and the
tests' golden env files are checked against it. stdlib only: it is imported by the
deploy (its tests and its printed command) on the controller and by ``serve.py`` inside
the serving container (Python 3.12 there, 3.11 here).

Rules beyond the table:
* every table variable the deploy always renders must be *present*; the ones whose
  empty value means "off" (parsers, speculative config) may be empty but not absent, so
  a deploy that forgets to pass them (the reference recipe's bug) fails loudly instead of silently
  serving without tool calls;
* secrets never reach argv: ``--api-key`` in the extra args is refused (vLLM reads
  ``VLLM_API_KEY`` from the environment).
"""
from __future__ import annotations

import json
import re
import shlex
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Patch names, in the contract's order (docs/architecture.md).
KNOWN_PATCHES = ("kv_unify", "prefix_align", "inc_fp8_shared", "int8_lmhead", "fla_shmem")
# Patches whose failure serve.py logs and tolerates (a free prefill win, never required).
TOLERATED_PATCHES = frozenset({"fla_shmem"})

# How the wrapper checks a variable's presence.
REQUIRED = "required"  # present and non-empty
PRESENT = "present"  # present; empty means "off"
OPTIONAL = "optional"  # may be absent; absent and empty mean the same
IF_SET = "if-set"  # the deploy writes it only when its setting is set
ENV = "env"  # environment for vLLM itself, not read by the wrapper


@dataclass(frozen=True)
class Var:
    """One serve.env variable, written once: the setting the deploy renders it from and how
    that value becomes text (``render``); how the wrapper checks it (``need``, ``check``)
    and what it makes of it (``argv`` with ``flag``); the example of the doc's table."""

    name: str
    setting: str  # attribute of sparkfleet's Settings; "" for a fixed value
    render: str  # text | number | switch | json | json-list | names | fixed
    example: str
    need: str = REQUIRED
    argv: str = "value"  # positional | value | value-if-set | switch | flag | json | args | plan | log | env
    flag: str = ""  # for value-if-set, the words before the value
    check: str = "word"  # word | int | rank | port | fraction (for value / value-if-set)
    fixed: str = ""
    note: str = ""

    @property
    def maps(self) -> str:
        """What the wrapper makes of it, in words (the doc's last column)."""
        return {
            "positional": "positional after `serve`",
            "value": f"`{self.flag}`",
            "value-if-set": f"`{self.flag} X` (none when empty)",
            "switch": f"`{self.flag}` / `--no-{self.flag[2:]}`",
            "flag": f"`{self.flag}` when `1`",
            "json": f"`{self.flag} JSON` (none when empty)",
            "args": "appended verbatim",
            "plan": "the patches applied before vLLM starts, in order",
            "log": "logged only",
            "env": "vLLM's environment",
        }[self.argv] + (f"; {self.note}" if self.note else "")


SERVE_ENV = (
    Var("SF_PROFILE", "profile", "text", "`dense`", OPTIONAL, "log"),
    Var("SF_MODEL", "serve_model", "text", "`bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid` or `/model`",
        argv="positional"),
    Var("SF_REVISION", "serve_revision", "text", "`main` / 40-hex", OPTIONAL, "value-if-set", "--revision",
        note="none for a local model path"),
    Var("SF_SERVED_MODEL_NAME", "served_model_name", "text", "`qwen`", flag="--served-model-name"),
    Var("SF_HOST", "bind_address", "text", "`0.0.0.0`", flag="--host"),
    Var("SF_PORT", "port", "text", "`8000`", flag="--port", check="port"),
    Var("SF_MAX_MODEL_LEN", "max_model_len", "text", "`262144`", flag="--max-model-len", check="int"),
    Var("SF_MAX_NUM_SEQS", "max_num_seqs", "text", "`3`", flag="--max-num-seqs", check="int"),
    Var("SF_MAX_NUM_BATCHED_TOKENS", "max_num_batched_tokens", "text", "`8192`",
        flag="--max-num-batched-tokens", check="int"),
    Var("SF_GPU_MEMORY_UTILIZATION", "gpu_memory_utilization", "number", "`0.82`",
        flag="--gpu-memory-utilization", check="fraction"),
    Var("SF_LOAD_FORMAT", "load_format", "text", "`fastsafetensors`", flag="--load-format"),
    Var("SF_ATTENTION_BACKEND", "attention_backend", "text", "`FLASH_ATTN`", flag="--attention-backend"),
    # An empty parser setting turns that parser off in every profile (MTP included).
    Var("SF_TOOL_CALL_PARSER", "tool_call_parser", "text", "`qwen3_xml`", PRESENT, "value-if-set",
        "--enable-auto-tool-choice --tool-call-parser"),
    Var("SF_REASONING_PARSER", "reasoning_parser", "text", "`qwen3`", PRESENT, "value-if-set",
        "--reasoning-parser"),
    # Switches are explicit both ways: vLLM's defaults differ between versions and models.
    Var("SF_CHUNKED_PREFILL", "chunked_prefill", "switch", "`1`/`0`", argv="switch",
        flag="--enable-chunked-prefill"),
    Var("SF_PREFIX_CACHING", "prefix_caching", "switch", "`0`/`1`", argv="switch",
        flag="--enable-prefix-caching"),
    # A pair member (config.Pair): vLLM's multi-node mode without Ray, one node per Spark.
    # Absent on a host that serves alone, so its serve.env and its command stay as they were.
    Var("SF_TENSOR_PARALLEL_SIZE", "pair.size", "text", "`2`", IF_SET, "value-if-set", "--tensor-parallel-size",
        check="int", note="a pair member only, as the next five"),
    Var("SF_NNODES", "pair.size", "text", "`2`", IF_SET, "value-if-set", "--nnodes", check="int"),
    Var("SF_NODE_RANK", "pair.rank", "text", "`0` (the head) / `1`", IF_SET, "value-if-set", "--node-rank",
        check="rank"),
    Var("SF_MASTER_ADDR", "pair.master_addr", "text", "`192.168.100.1`", IF_SET, "value-if-set", "--master-addr",
        note="the head's address on the ConnectX-7 link"),
    Var("SF_MASTER_PORT", "pair.port", "text", "`29500`", IF_SET, "value-if-set", "--master-port", check="port"),
    Var("SF_HEADLESS", "pair.headless", "switch", "`0` (the head) / `1`", IF_SET, "flag", "--headless",
        note="ranks above 0 serve no HTTP"),
    # Cross-node CUDA graphs abort at capture on GB10 before the image builder's 0.27.1 image (vLLM #46253).
    Var("SF_ENFORCE_EAGER", "pair.enforce_eager", "switch", "`1`", IF_SET, "flag", "--enforce-eager",
        note="a pair member only (`pair_enforce_eager`): no cross-node CUDA graphs"),
    Var("SF_DISABLE_CUSTOM_ALL_REDUCE", "pair.disable_custom_all_reduce", "switch", "`1`", IF_SET, "flag",
        "--disable-custom-all-reduce", note="a pair member only: vLLM's custom all-reduce is single-node NVLink"),
    Var("SF_SPECULATIVE_CONFIG", "speculative_config", "json", "JSON object with a `method`", PRESENT, "json",
        "--speculative-config"),
    Var("SF_MIDDLEWARE", "serve_middleware", "text", "`key_guard.KeyGuard`", OPTIONAL, "value-if-set",
        "--middleware", note="with an API key: every route needs it, not only /v1 (runtime/key_guard.py)"),
    Var("SF_EXTRA_ARGS", "extra_serve_args", "json-list", "JSON list of strings", OPTIONAL, "args"),
    Var("SF_PATCHES", "patch_plan", "names", "`kv_unify,fla_shmem`", OPTIONAL, "plan"),
    Var("HF_HOME", "", "fixed", "`/hf`", ENV, "env", fixed="/hf", note="the host's HF cache is mounted there"),
    Var("VLLM_CACHE_ROOT", "", "fixed", "`/hf/.vllm_cache`", ENV, "env", fixed="/hf/.vllm_cache",
        note="vLLM's caches (torch.compile) beside the HF cache"),
    # Each start is a new container (`docker run --rm`): a JIT cache kept in it is rebuilt
    # at every restart (minutes on a GB10: runtime/startup.py). All live beside vLLM's, on the host.
    Var("TRITON_CACHE_DIR", "", "fixed", "`/hf/.vllm_cache/triton`", ENV, "env", fixed="/hf/.vllm_cache/triton",
        note="Triton's kernels (autotuned) survive restarts"),
    Var("FLASHINFER_WORKSPACE_BASE", "", "fixed", "`/hf/.vllm_cache`", ENV, "env", fixed="/hf/.vllm_cache",
        note="FlashInfer's JIT kernels (`.cache/flashinfer` under it) survive restarts"),
    Var("TORCHINDUCTOR_CACHE_DIR", "", "fixed", "`/hf/.vllm_cache/inductor`", ENV, "env",
        fixed="/hf/.vllm_cache/inductor", note="inductor's own kernels (else /tmp in the container)"),
    Var("CUDA_CACHE_PATH", "", "fixed", "`/hf/.vllm_cache/nv`", ENV, "env", fixed="/hf/.vllm_cache/nv",
        note="the driver's PTX JIT cache (else ~/.nv in the container)"),
    Var("HF_HUB_OFFLINE", "", "fixed", "`1`", ENV, "env", fixed="1",
        note="the deploy fetched everything: starting never waits on the hub"),
    Var("VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS", "", "fixed", "`0`", ENV, "env", fixed="0",
        note="the memory profiler otherwise over-reserves for CUDA graphs on GB10"),
    Var("HF_ENDPOINT", "hf_endpoint", "text", "`http://10.0.0.1:8090`", IF_SET, "env",
        note="written only when `hf_endpoint` is set"),
    # A pair member: where NCCL, Gloo and vLLM talk (the link); `vllm_env` overrides them.
    Var("VLLM_HOST_IP", "pair.address", "text", "`192.168.100.2`", IF_SET, "env",
        note="this member's address on the link (a pair member only, as the next six)"),
    Var("NCCL_SOCKET_IFNAME", "pair.interface", "text", "`enp1s0f1np1`", IF_SET, "env"),
    Var("GLOO_SOCKET_IFNAME", "pair.interface", "text", "`enp1s0f1np1`", IF_SET, "env"),
    Var("TP_SOCKET_IFNAME", "pair.interface", "text", "`enp1s0f1np1`", IF_SET, "env"),
    Var("NCCL_IB_HCA", "pair.hcas", "text", "`rocep1s0f1,roceP2p1s0f1`", IF_SET, "env",
        note="the RoCE devices of the cabled port"),
    Var("NCCL_IB_GID_INDEX", "pair.gid_index", "text", "`3`", IF_SET, "env",
        note="the RoCE v2 GID of the link's address (`pair_gid_index`); a wrong one falls back to sockets"),
    Var("NCCL_IB_DISABLE", "pair.ib_disable", "text", "`0`", IF_SET, "env", note="NCCL over RoCE, not sockets"),
    Var("NCCL_IGNORE_CPU_AFFINITY", "pair.ignore_cpu_affinity", "text", "`1`", IF_SET, "env",
        note="as the community recipes for Spark pairs set it"),
)
VARS = {var.name: var for var in SERVE_ENV}
REQUIRED_VARS = tuple(v.name for v in SERVE_ENV if v.need == REQUIRED)
PRESENT_VARS = tuple(v.name for v in SERVE_ENV if v.need == PRESENT)
OPTIONAL_VARS = tuple(v.name for v in SERVE_ENV if v.need == OPTIONAL)

_RENDER: dict[str, Callable[[Any], str]] = {
    "text": lambda value: "" if value is None else str(value),
    "number": lambda value: f"{value:g}",  # 0.82 stays "0.82"
    "switch": lambda value: "1" if value else "0",
    "json": lambda value: json.dumps(value, separators=(",", ":")) if value else "",
    "json-list": lambda value: json.dumps(value) if value else "",
    "names": lambda value: ",".join(value),
}


def render_env(setting: Callable[[str], Any]) -> dict[str, str]:
    """serve.env in the table's order; ``setting(name)`` gives a setting's value."""
    env: dict[str, str] = {}
    for var in SERVE_ENV:
        if var.render == "fixed":
            env[var.name] = var.fixed
            continue
        value = setting(var.setting)
        if var.need == IF_SET and value in (None, ""):
            continue
        env[var.name] = _RENDER[var.render](value)
    return env


def doc_table() -> str:
    """docs/architecture.md's serve.env table, generated from SERVE_ENV."""
    rows = ["| variable | from setting | example | what the wrapper does with it |", "|---|---|---|---|"]
    for var in SERVE_ENV:
        source = f"`{var.setting}`" if var.setting else "fixed"
        rows.append(f"| `{var.name}` | {source} | {var.example} | {var.maps} |")
    return "\n".join(rows) + "\n"


# Flags that would carry a secret; secrets travel in secrets.env only.
_SECRET_FLAGS = ("--api-key", "--hf-token")
_WORD = re.compile(r"^[A-Za-z0-9._:/@+-]+$")


class ServeEnvError(ValueError):
    """serve.env is incomplete or invalid; the message names the variable."""


def _get(env: Mapping[str, str], key: str) -> str:
    return (env.get(key) or "").strip()


def _check_presence(env: Mapping[str, str]) -> None:
    missing = [k for k in REQUIRED_VARS if not _get(env, k)]
    missing += [k for k in PRESENT_VARS if k not in env]
    if missing:
        raise ServeEnvError(f"serve.env: missing required variable(s): {', '.join(missing)}")


def _word(env: Mapping[str, str], key: str) -> str:
    value = _get(env, key)
    if value and (not _WORD.match(value) or value.startswith("-")):
        raise ServeEnvError(f"{key}={value!r}: not a plain name/value")
    return value


def _int(env: Mapping[str, str], key: str, lo: int = 1, hi: int | None = None) -> str:
    raw = _get(env, key)
    try:
        value = int(raw)
    except ValueError:
        raise ServeEnvError(f"{key}={raw!r}: not an integer") from None
    if value < lo or (hi is not None and value > hi):
        bound = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise ServeEnvError(f"{key}={raw!r}: must be {bound}")
    return str(value)


def _fraction(env: Mapping[str, str], key: str) -> str:
    raw = _get(env, key)
    try:
        value = float(raw)
    except ValueError:
        raise ServeEnvError(f"{key}={raw!r}: not a number") from None
    if not 0.0 < value <= 1.0:
        raise ServeEnvError(f"{key}={raw!r}: must be in (0, 1]")
    return raw  # verbatim: "0.82" stays "0.82"


def _flag01(env: Mapping[str, str], key: str) -> bool:
    raw = _get(env, key)
    if raw not in ("0", "1"):
        raise ServeEnvError(f"{key}={raw!r}: must be 1 or 0")
    return raw == "1"


def model_is_path(model: str) -> bool:
    """A local checkpoint (``/model``, ``./ckpt``) rather than a hub repo id."""
    return model.startswith(("/", "./", "../", "~"))


def speculative_config(env: Mapping[str, str]) -> dict | None:
    raw = _get(env, "SF_SPECULATIVE_CONFIG")
    if not raw:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ServeEnvError(f"SF_SPECULATIVE_CONFIG: not JSON: {exc}") from None
    if not isinstance(value, dict) or not value.get("method"):
        raise ServeEnvError("SF_SPECULATIVE_CONFIG: must be a JSON object with a 'method'")
    return value


def extra_args(env: Mapping[str, str]) -> list[str]:
    raw = _get(env, "SF_EXTRA_ARGS")
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ServeEnvError(f"SF_EXTRA_ARGS: not JSON: {exc}") from None
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        raise ServeEnvError("SF_EXTRA_ARGS: must be a JSON list of strings")
    for arg in value:
        if arg.split("=", 1)[0] in _SECRET_FLAGS:
            raise ServeEnvError(f"SF_EXTRA_ARGS: {arg.split('=', 1)[0]} is refused: secrets go in secrets.env")
    return value


def patches_for(env: Mapping[str, str]) -> list[str]:
    """The patches ``SF_PATCHES`` names, in order (empty/absent: none)."""
    raw = _get(env, "SF_PATCHES")
    names = [p.strip() for p in raw.split(",") if p.strip()] if raw else []
    unknown = [p for p in names if p not in KNOWN_PATCHES]
    if unknown:
        raise ServeEnvError(
            f"SF_PATCHES: unknown patch(es) {', '.join(unknown)}; known: {', '.join(KNOWN_PATCHES)}"
        )
    if len(set(names)) != len(names):
        raise ServeEnvError(f"SF_PATCHES={raw!r}: a patch is listed twice")
    return names


def _value(env: Mapping[str, str], var: Var) -> str:
    if var.check == "int":
        return _int(env, var.name)
    if var.check == "rank":
        return _int(env, var.name, 0)
    if var.check == "port":
        return _int(env, var.name, 1, 65535)
    if var.check == "fraction":
        return _fraction(env, var.name)
    return _word(env, var.name)


def argv_parts(env: Mapping[str, str]) -> list[tuple[str, list[str]]]:
    """(variable, the words it adds after ``vllm serve``), in SERVE_ENV's order: the
    pieces of ``build_serve_argv``, so a word vLLM refuses can be traced to its variable.

    Raises ServeEnvError naming the first offending variable(s)."""
    _check_presence(env)
    model = _get(env, "SF_MODEL")
    if model.startswith("-") or any(c.isspace() for c in model):
        raise ServeEnvError(f"SF_MODEL={model!r}: not a repo id or path")
    parts: list[tuple[str, list[str]]] = []
    for var in SERVE_ENV:
        words: list[str] = []
        if var.argv == "positional":
            words = [model]
        elif var.argv == "value":
            words = [var.flag, _value(env, var)]
        elif var.argv == "value-if-set":
            value = _value(env, var) if _get(env, var.name) else ""
            if value and not (var.name == "SF_REVISION" and model_is_path(model)):
                words = [*var.flag.split(), value]
        elif var.argv == "switch":
            words = [var.flag if _flag01(env, var.name) else f"--no-{var.flag[2:]}"]
        elif var.argv == "flag":
            words = [var.flag] if var.name in env and _flag01(env, var.name) else []
        elif var.argv == "json":
            spec = speculative_config(env)
            if spec is not None:
                words = [var.flag, json.dumps(spec, separators=(",", ":"))]
        elif var.argv == "args":
            words = extra_args(env)
        elif var.argv == "plan":
            patches_for(env)  # validate here too: a bad SF_PATCHES must fail the deploy's tests
        if words:
            parts.append((var.name, words))
    return parts


def build_serve_argv(env: Mapping[str, str]) -> list[str]:
    """The full ``vllm serve`` argv for a serve.env mapping, in SERVE_ENV's order.

    Raises ServeEnvError naming the first offending variable(s)."""
    return ["vllm", "serve", *(word for _, words in argv_parts(env) for word in words)]


def render_command(env: Mapping[str, str]) -> str:
    """The argv as one shell-quoted line, for logs and the deploy's printout."""
    return shlex.join(build_serve_argv(env))
