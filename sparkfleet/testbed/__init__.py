"""The simulated Spark fleet (testbed): real Linux hosts in systemd-nspawn containers.

Public API (imported lazily, so `python -m sparkfleet.testbed.hub` stays light):

    from sparkfleet.testbed import up, down, status, load, Testbed
    tb = up(3)                       # or load() for the running fleet
    tb.hosts, tb.inventory_path      # HostState records; inventory/testbed.py
    tb.exec("spark-1", "nvidia-smi") # as root by nsenter (via="ssh": over real SSH and sudo)
    tb.restart_host("spark-2")       # reboot: same overlay, new boot
    tb.stop_host / start_host / kill_host / set_link / unreachable(...)
    with tb.switched("spark-2", gpu="NVIDIA H100 80GB HBM3"): ...
    restart_host(name), host_exec(name, cmd), stop_host(name), start_host(name)

See docs/architecture.md ("The simulated fleet") and sparkfleet/testbed/README.md.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "Testbed": "fleet", "up": "fleet", "down": "fleet", "status": "fleet", "load": "fleet",
    "restart_host": "fleet", "stop_host": "fleet", "start_host": "fleet", "host_exec": "fleet",
    "TestbedError": "proc",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'sparkfleet.testbed' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)
