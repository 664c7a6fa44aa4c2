"""Per-host switches of the simulated hardware (docs/architecture.md).

`gpu` (name, e.g. "NVIDIA H100 80GB HBM3") with optional `compute_cap` ("9.0"; looked up
from the name if absent), `arch` ("x86_64"), `disk_full`, `no_nvidia_runtime` and
`driver_mismatch` (booleans; the last: the driver was updated without a reboot, so
nvidia-smi and every new GPU container fail with NVML's version mismatch). On the CLI: `--switch spark-2:gpu=NVIDIA H100 80GB HBM3`,
`--switch spark-1:disk_full`, `--switch spark-3:arch=x86_64`.
"""

from __future__ import annotations

from typing import Any

BOOL_SWITCHES = {"disk_full", "desktop", "no_nvidia_runtime", "driver_mismatch", "nvidia_runtime", "cdi", "containerd_store"}  # hostkinds.py: the last three
STR_SWITCHES = {"gpu", "compute_cap", "arch"}
ALL_SWITCHES = BOOL_SWITCHES | STR_SWITCHES


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("", "1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"switch {key}: not a boolean: {value!r}")


def normalize(switches: dict[str, Any]) -> dict[str, Any]:
    """Validate and canonicalise a switch dict; false/empty switches are dropped."""
    out: dict[str, Any] = {}
    for key, value in switches.items():
        if key not in ALL_SWITCHES:
            raise ValueError(f"unknown switch {key!r}; known: {', '.join(sorted(ALL_SWITCHES))}")
        if key in BOOL_SWITCHES:
            if _as_bool(key, value):
                out[key] = True
        elif value is not None and str(value).strip():
            out[key] = str(value).strip()
    if "compute_cap" in out and "gpu" not in out:
        raise ValueError("switch compute_cap needs gpu as well")
    if "arch" in out and out["arch"] not in ("x86_64", "aarch64"):
        raise ValueError(f"switch arch: expected x86_64 or aarch64, got {out['arch']!r}")
    return out


def parse_specs(specs: list[str], host_names: list[str]) -> dict[str, dict[str, Any]]:
    """Parse `HOST:KEY[=VALUE]` CLI specs into {host: {switch: value}}."""
    result: dict[str, dict[str, Any]] = {}
    for spec in specs:
        host, sep, rest = spec.partition(":")
        if not sep or not rest:
            raise ValueError(f"bad --switch {spec!r}: expected HOST:KEY[=VALUE]")
        if host not in host_names:
            raise ValueError(f"bad --switch {spec!r}: no host {host!r} (hosts: {', '.join(host_names)})")
        key, eq, value = rest.partition("=")
        result.setdefault(host, {})[key.strip()] = value if eq else True
    return {h: normalize(s) for h, s in result.items()}
