#!/usr/bin/python3
"""Simulated `nvidia-smi` of a DGX Spark (GB10), installed as /usr/bin/nvidia-smi.

Standalone, stdlib only: it is copied verbatim into each simulated host. It answers the
way the real tool does on a GB10: name `NVIDIA GB10`, compute capability 12.1, and
`[N/A]` for the framebuffer memory fields (GB10 has unified memory, so nvidia-smi
reports no dedicated memory). The per-host switch file (JSON, see the testbed docs)
can turn it into another GPU (`gpu`, `compute_cap`), or into a host whose driver was
updated without a reboot (`driver_mismatch`): then every call but `-h` fails as the real
tool does, with NVML's "Driver/library version mismatch" and exit status 18.

Supported: plain table; `-L`; `--query-gpu=a,b --format=csv[,noheader][,nounits]`;
`-i/--id` 0; `--version`; `-q` (short). Unknown query fields fail like the real tool.
"""

from __future__ import annotations

import json
import os
import sys
import time

SIM_DIR = os.environ.get("SPARKFLEET_SIM_DIR", "/etc/sparkfleet-sim")

GB10 = {
    "name": "NVIDIA GB10",
    "compute_cap": "12.1",
    "driver_version": "580.95.05",
    "cuda_version": "13.0",
    "uuid": "GPU-5b3c0e7a-4f1d-8e2a-9c6b-0d1e2f3a4b5c",
    "pci_bus_id": "0000000F:01:00.0",
    "vbios_version": "[N/A]",
    "memory": None,  # unified memory: reported as [N/A]
}

#: The userspace a driver update without a reboot leaves beside the loaded kernel module
#: (the `driver_mismatch` switch).
UPDATED_LIBRARY = "580.126.09"
#: The simulated driver package's userspace version, and the module's loaded at boot
#: (simhw/__init__.py): they differ after an install without a reboot.
LIBRARY_FILE = "/usr/lib/sparkfleet-sim/nvidia-driver.version"
MODULE_FILE = "/run/sparkfleet-sim/nvidia-module.version"
#: nvidia-smi's status for NVML_ERROR_LIB_RM_VERSION_MISMATCH.
MISMATCH_STATUS = 18
#: The module noted at boot when the booted kernel has none (apply_switches.py), and
#: nvidia-smi's status then (NVML_ERROR_DRIVER_NOT_LOADED).
NO_MODULE = "none"
NOT_LOADED_STATUS = 9


#: Known compute capabilities, for a `gpu` switch given without `compute_cap`.
KNOWN_CC = {
    "GB10": "12.1", "H100": "9.0", "H200": "9.0", "GH200": "9.0", "A100": "8.0",
    "L40S": "8.9", "L4": "8.9", "RTX 4090": "8.9", "A10": "8.6", "B200": "10.0",
    "T4": "7.5", "V100": "7.0",
}


def load_switches() -> dict:
    try:
        with open(os.path.join(SIM_DIR, "switches.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def driver() -> tuple[str, str]:
    """(kernel module, library) versions: the package's and the one loaded at boot."""
    library = _read(LIBRARY_FILE) or GB10["driver_version"]
    return _read(MODULE_FILE) or library, library


def gpu_info() -> dict:
    info = dict(GB10)
    info["driver_version"] = driver()[0]
    sw = load_switches()
    if sw.get("gpu"):
        info["name"] = str(sw["gpu"])
        cc = sw.get("compute_cap")
        if not cc:
            cc = next((v for k, v in KNOWN_CC.items() if k in info["name"]), "8.0")
        info["compute_cap"] = str(cc)
        info["memory"] = int(sw.get("memory_mib", 81559))
        info["pci_bus_id"] = "00000000:01:00.0"
    return info


# field -> (header unit or "", value function taking info). A unit is stripped by nounits.
def _mem(info, which):
    m = info["memory"]
    if m is None:
        return "[N/A]", "MiB"
    return {"total": str(m), "used": "0", "free": str(m), "reserved": "0"}[which], "MiB"


FIELDS = {
    "index": lambda i: ("0", ""),
    "count": lambda i: ("1", ""),
    "name": lambda i: (i["name"], ""),
    "gpu_name": lambda i: (i["name"], ""),
    "compute_cap": lambda i: (i["compute_cap"], ""),
    "driver_version": lambda i: (i["driver_version"], ""),
    "uuid": lambda i: (i["uuid"], ""),
    "gpu_uuid": lambda i: (i["uuid"], ""),
    "serial": lambda i: ("[N/A]", ""),
    "pci.bus_id": lambda i: (i["pci_bus_id"], ""),
    "gpu_bus_id": lambda i: (i["pci_bus_id"], ""),
    "vbios_version": lambda i: (i["vbios_version"], ""),
    "persistence_mode": lambda i: ("Enabled", ""),
    "pstate": lambda i: ("P0", ""),
    "temperature.gpu": lambda i: ("42", ""),
    "utilization.gpu": lambda i: ("0", "%"),
    "utilization.memory": lambda i: ("[N/A]", "%"),
    "power.draw": lambda i: ("11.42", "W"),
    "power.limit": lambda i: ("[N/A]", "W"),
    "clocks.sm": lambda i: ("2418", "MHz"),
    "clocks.max.sm": lambda i: ("3003", "MHz"),
    "memory.total": lambda i: _mem(i, "total"),
    "memory.used": lambda i: _mem(i, "used"),
    "memory.free": lambda i: _mem(i, "free"),
    "memory.reserved": lambda i: _mem(i, "reserved"),
    "mig.mode.current": lambda i: ("[N/A]", ""),
    "compute_mode": lambda i: ("Default", ""),
}


def query(fields: list[str], fmt: set[str]) -> int:
    info = gpu_info()
    unknown = [f for f in fields if f not in FIELDS]
    if unknown:
        print(f'Field "{unknown[0]}" is not a valid field to query.\n', file=sys.stderr)
        print("Please run `nvidia-smi --help-query-gpu` for more information.", file=sys.stderr)
        return 2
    nounits = "nounits" in fmt
    rows = []
    header = []
    cells = []
    for f in fields:
        val, unit = FIELDS[f](info)
        header.append(f"{f} [{unit}]" if unit and not nounits else f)
        if unit and not nounits and not val.startswith("["):
            val = f"{val} {unit}"
        cells.append(val)
    if "noheader" not in fmt:
        rows.append(", ".join(header))
    rows.append(", ".join(cells))
    print("\n".join(rows))
    return 0


def table() -> str:
    i = gpu_info()
    now = time.strftime("%a %b %d %H:%M:%S %Y")
    mem = "Not Supported" if i["memory"] is None else f"0MiB / {i['memory']}MiB"
    w = 89
    lines = [
        f"{now}       ",
        "+" + "-" * w + "+",
        f"| NVIDIA-SMI {i['driver_version']:<22} Driver Version: {i['driver_version']:<14} CUDA Version: {i['cuda_version']:<9}|",
        "+-----------------------------------------+------------------------+----------------------+",
        "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
        "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
        "|                                         |                        |               MIG M. |",
        "|=========================================+========================+======================|",
        f"|   0  {i['name'][:30]:<31}On  | {i['pci_bus_id']:>18} Off |                  N/A |",
        f"| N/A   42C    P0             11W /  N/A  | {mem:<22} |      0%      Default |",
        "|                                         |                        |                  N/A |",
        "+-----------------------------------------+------------------------+----------------------+",
        "",
        "+" + "-" * w + "+",
        "| Processes:" + " " * (w - 11) + "|",
        "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
        "|        ID   ID                                                               Usage      |",
        "|" + "=" * w + "|",
        "|  No running processes found" + " " * (w - 28) + "|",
        "+" + "-" * w + "+",
    ]
    return "\n".join(lines)


def mismatch(library: str) -> int:
    """What nvidia-smi prints when the library is newer than the kernel module."""
    print("Failed to initialize NVML: Driver/library version mismatch")
    print(f"NVML library version: {library.rsplit('.', 1)[0]}")
    return MISMATCH_STATUS


def not_loaded() -> int:
    """What nvidia-smi prints when no NVIDIA kernel module is loaded."""
    print("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
          "Make sure that the latest NVIDIA driver is installed and running.")
    return NOT_LOADED_STATUS


def main(argv: list[str]) -> int:
    if not {"-h", "--help"} & set(argv):
        module, library = driver()
        if module == NO_MODULE:
            return not_loaded()
        if load_switches().get("driver_mismatch"):
            return mismatch(UPDATED_LIBRARY)
        if module != library:
            return mismatch(library)
    fields: list[str] | None = None
    fmt: set[str] = set()
    args = list(argv)
    while args:
        a = args.pop(0)
        if a.startswith("--query-gpu="):
            fields = [f.strip() for f in a.split("=", 1)[1].split(",") if f.strip()]
        elif a == "--query-gpu" and args:
            fields = [f.strip() for f in args.pop(0).split(",") if f.strip()]
        elif a.startswith("--format="):
            fmt = {f.strip() for f in a.split("=", 1)[1].split(",")}
        elif a == "--format" and args:
            fmt = {f.strip() for f in args.pop(0).split(",")}
        elif a in ("-i", "--id") and args:
            if args.pop(0) not in ("0", gpu_info()["uuid"], gpu_info()["pci_bus_id"]):
                print("No devices were found", file=sys.stderr)
                return 6
        elif a.startswith("--id="):
            if a.split("=", 1)[1] != "0":
                print("No devices were found", file=sys.stderr)
                return 6
        elif a in ("-L", "--list-gpus"):
            i = gpu_info()
            print(f"GPU 0: {i['name']} (UUID: {i['uuid']})")
            return 0
        elif a == "--version":
            i = gpu_info()
            print(f"NVIDIA-SMI version  : {i['driver_version']}\nNVML version        : 580.95\n"
                  f"DRIVER version      : {i['driver_version']}\nCUDA Version        : {i['cuda_version']}")
            return 0
        elif a in ("-q", "--query"):
            i = gpu_info()
            print(f"\n==============NVSMI LOG==============\n\nDriver Version                            : {i['driver_version']}\n"
                  f"CUDA Version                              : {i['cuda_version']}\n\nAttached GPUs                             : 1\n"
                  f"GPU {i['pci_bus_id']}\n    Product Name                          : {i['name']}\n"
                  f"    GPU UUID                              : {i['uuid']}\n")
            return 0
        elif a in ("-h", "--help"):
            print("NVIDIA System Management Interface -- v" + gpu_info()["driver_version"] + " (simulated by sparkfleet testbed)")
            return 0
        else:
            print("Invalid combination of input arguments. Please run 'nvidia-smi -h' for help.", file=sys.stderr)
            return 2
    if fields is not None:
        if not fmt or "csv" not in fmt:
            print('"--format" must be specified with "--query-gpu" (e.g. --format=csv)', file=sys.stderr)
            return 2
        return query(fields, fmt)
    print(table())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
