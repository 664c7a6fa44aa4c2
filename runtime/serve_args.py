"""serve.env -> ``vllm serve`` argv: the ONE place the serving command is built.

Implements the serve.env table of docs/architecture.md. stdlib only: it is imported by
the deploy (its tests and its printed command) on the controller and by ``serve.py``
inside the serving container (Python 3.12 there, 3.11 here).

Rules beyond the table:
* every table variable the deploy always renders must be *present*; the ones whose
  empty value means "off" (parsers, speculative config) may be empty but not absent, so
  a deploy that forgets to pass them (the seeds' bug) fails loudly instead of silently
  serving without tool calls;
* secrets never reach argv: ``--api-key`` in the extra args is refused (vLLM reads
  ``VLLM_API_KEY`` from the environment).
"""
from __future__ import annotations

import json
import re
import shlex
from typing import Mapping

# Patch names, in the contract's order (docs/architecture.md).
KNOWN_PATCHES = ("kv_unify", "prefix_align", "inc_fp8_shared", "int8_lmhead", "fla_shmem")
# Patches whose failure serve.py logs and tolerates (a free prefill win, never required).
TOLERATED_PATCHES = frozenset({"fla_shmem"})

# Must be present and non-empty.
REQUIRED = (
    "SF_MODEL",
    "SF_SERVED_MODEL_NAME",
    "SF_HOST",
    "SF_PORT",
    "SF_MAX_MODEL_LEN",
    "SF_MAX_NUM_SEQS",
    "SF_MAX_NUM_BATCHED_TOKENS",
    "SF_GPU_MEMORY_UTILIZATION",
    "SF_LOAD_FORMAT",
    "SF_ATTENTION_BACKEND",
    "SF_CHUNKED_PREFILL",
    "SF_PREFIX_CACHING",
)
# Must be present; empty means "off".
PRESENT = ("SF_TOOL_CALL_PARSER", "SF_REASONING_PARSER", "SF_SPECULATIVE_CONFIG")
# May be absent; absent and empty mean the same.
OPTIONAL = ("SF_REVISION", "SF_EXTRA_ARGS", "SF_PATCHES", "SF_PROFILE")

# Flags that would carry a secret; secrets travel in secrets.env only.
_SECRET_FLAGS = ("--api-key", "--hf-token")
_WORD = re.compile(r"^[A-Za-z0-9._:/@+-]+$")


class ServeEnvError(ValueError):
    """serve.env is incomplete or invalid; the message names the variable."""


def _get(env: Mapping[str, str], key: str) -> str:
    return (env.get(key) or "").strip()


def _check_presence(env: Mapping[str, str]) -> None:
    missing = [k for k in REQUIRED if not _get(env, k)]
    missing += [k for k in PRESENT if k not in env]
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


def build_serve_argv(env: Mapping[str, str]) -> list[str]:
    """The full ``vllm serve`` argv for a serve.env mapping (flags in the table's order).

    Raises ServeEnvError naming the first offending variable(s)."""
    _check_presence(env)
    model = _get(env, "SF_MODEL")
    if model.startswith("-") or any(c.isspace() for c in model):
        raise ServeEnvError(f"SF_MODEL={model!r}: not a repo id or path")
    argv = ["vllm", "serve", model]

    revision = _word(env, "SF_REVISION")
    if revision and not model_is_path(model):
        argv += ["--revision", revision]
    argv += ["--served-model-name", _word(env, "SF_SERVED_MODEL_NAME")]
    argv += ["--host", _word(env, "SF_HOST")]
    argv += ["--port", _int(env, "SF_PORT", 1, 65535)]
    argv += ["--max-model-len", _int(env, "SF_MAX_MODEL_LEN")]
    argv += ["--max-num-seqs", _int(env, "SF_MAX_NUM_SEQS")]
    argv += ["--max-num-batched-tokens", _int(env, "SF_MAX_NUM_BATCHED_TOKENS")]
    argv += ["--gpu-memory-utilization", _fraction(env, "SF_GPU_MEMORY_UTILIZATION")]
    argv += ["--load-format", _word(env, "SF_LOAD_FORMAT")]
    argv += ["--attention-backend", _word(env, "SF_ATTENTION_BACKEND")]

    # An empty parser setting turns that parser off in every profile (MTP included).
    tool_parser = _word(env, "SF_TOOL_CALL_PARSER")
    if tool_parser:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    reasoning_parser = _word(env, "SF_REASONING_PARSER")
    if reasoning_parser:
        argv += ["--reasoning-parser", reasoning_parser]

    chunked = _flag01(env, "SF_CHUNKED_PREFILL")
    argv.append("--enable-chunked-prefill" if chunked else "--no-enable-chunked-prefill")
    prefix = _flag01(env, "SF_PREFIX_CACHING")
    # Explicit both ways: vLLM's default differs between versions and model types.
    argv.append("--enable-prefix-caching" if prefix else "--no-enable-prefix-caching")

    spec = speculative_config(env)
    if spec is not None:
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]

    argv += extra_args(env)
    patches_for(env)  # validate here too: a bad SF_PATCHES must fail the deploy's tests
    return argv


def render_command(env: Mapping[str, str]) -> str:
    """The argv as one shell-quoted line, for logs and the deploy's printout."""
    return shlex.join(build_serve_argv(env))
