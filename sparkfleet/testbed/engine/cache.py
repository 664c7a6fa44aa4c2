"""Model resolution from the local Hugging Face cache only, as vLLM does with
``HF_HUB_OFFLINE=1``: the path itself or its cached snapshot, honouring ``--revision``.
It never downloads: a missing snapshot or weight shard is a startup error."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .logs import StartupError

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


