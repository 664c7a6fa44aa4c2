#!/usr/bin/python3
"""Simulated `nvidia-ctk` (NVIDIA Container Toolkit CLI), stdlib only.

Installed as /usr/bin/nvidia-ctk by the simulated `nvidia-container-toolkit` package.
Implements what a deploy uses: `--version`, `runtime configure --runtime=docker
[--config=PATH] [--set-as-default]`, which merges the `nvidia` runtime into docker's
daemon.json exactly as the real tool does (other keys are kept), and `system
create-dev-char-symlinks [--create-all]`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

VERSION = "1.17.8"


def configure(args: argparse.Namespace) -> int:
    if args.runtime != "docker":
        print(f"unsupported runtime: {args.runtime} (simulated nvidia-ctk knows docker)", file=sys.stderr)
        return 1
    path = args.config or "/etc/docker/daemon.json"
    try:
        with open(path) as f:
            text = f.read()
        cfg = json.loads(text) if text.strip() else {}
    except FileNotFoundError:
        cfg = {}
    except ValueError as exc:
        print(f"unable to load config: {path}: {exc}", file=sys.stderr)
        return 1
    runtimes = cfg.setdefault("runtimes", {})
    runtimes["nvidia"] = {"args": [], "path": "nvidia-container-runtime"}
    if args.set_as_default:
        cfg["default-runtime"] = "nvidia"
    if args.dry_run:
        print(json.dumps(cfg, indent=4))
        return 0
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(cfg, f, indent=4)
        f.write("\n")
    os.replace(tmp, path)
    print(f'level=info msg="Wrote updated config to {path}"', file=sys.stderr)
    print('level=info msg="It is recommended that docker daemon be restarted."', file=sys.stderr)
    return 0


def dev_char_symlinks(create_all: bool) -> int:
    """/dev/char/MAJOR:MINOR -> the NVIDIA device node, for each node there is (none on
    a CPU machine); the call is recorded in /run/sparkfleet-sim/ctk.log for tests."""
    import glob

    os.makedirs("/dev/char", exist_ok=True)
    for node in glob.glob("/dev/nvidia*"):
        st = os.stat(node)
        link = f"/dev/char/{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}"
        if not os.path.lexists(link):
            os.symlink(os.path.relpath(node, "/dev/char"), link)
    os.makedirs("/run/sparkfleet-sim", exist_ok=True)
    with open("/run/sparkfleet-sim/ctk.log", "a") as log:
        log.write(f"system create-dev-char-symlinks{' --create-all' if create_all else ''}\n")
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="nvidia-ctk")
    p.add_argument("--version", "-v", action="store_true")
    p.add_argument("--debug", "-d", action="store_true")
    sub = p.add_subparsers(dest="cmd")
    rt = sub.add_parser("runtime")
    rsub = rt.add_subparsers(dest="rcmd")
    c = rsub.add_parser("configure")
    c.add_argument("--runtime", default="docker")
    c.add_argument("--config", default="")
    c.add_argument("--set-as-default", action="store_true")
    c.add_argument("--dry-run", action="store_true")
    c.add_argument("--cdi.enabled", dest="cdi_enabled", action="store_true")
    cdi = sub.add_parser("cdi")
    csub = cdi.add_subparsers(dest="ccmd")
    g = csub.add_parser("generate")
    g.add_argument("--output", default="")
    csub.add_parser("list")
    sub.add_parser("info")
    system = sub.add_parser("system")
    ssub = system.add_subparsers(dest="scmd")
    links = ssub.add_parser("create-dev-char-symlinks")
    links.add_argument("--create-all", action="store_true")
    args = p.parse_args(argv)
    if args.version:
        print(f"NVIDIA Container Toolkit CLI version {VERSION}\ncommit: simulated-sparkfleet-testbed")
        return 0
    if args.cmd == "runtime" and args.rcmd == "configure":
        return configure(args)
    if args.cmd == "cdi" and args.ccmd == "generate":
        spec = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
                "devices": [{"name": "0", "containerEdits": {}}, {"name": "all", "containerEdits": {}}],
                "containerEdits": {}}
        out = json.dumps(spec, indent=2)
        if args.output:
            with open(args.output, "w") as f:
                f.write(out + "\n")
        else:
            print(out)
        return 0
    if args.cmd == "cdi" and args.ccmd == "list":
        print("nvidia.com/gpu=0\nnvidia.com/gpu=all")
        return 0
    if args.cmd == "system" and args.scmd == "create-dev-char-symlinks":
        return dev_char_symlinks(args.create_all)
    if args.cmd == "info":
        print(f"NVIDIA Container Toolkit CLI version {VERSION} (simulated)")
        return 0
    p.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
