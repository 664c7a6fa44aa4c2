"""`sparkfleet testbed up|down|status|exec|restart|reset` (run as root).

    sparkfleet testbed up --hosts 3 [--switch 'spark-2:gpu=NVIDIA H100 80GB HBM3'] [--login dgx] [--names alias] ...
    sparkfleet testbed status [--json]
    sparkfleet testbed exec spark-1 -- nvidia-smi
    sparkfleet testbed restart spark-2
    sparkfleet testbed reset spark-2 --kernel-error 'NVRM: Xid (PCI:000f:01:00): 79, GPU has fallen off the bus.'
    sparkfleet testbed down
"""

from __future__ import annotations

import argparse
import json
import sys

from . import login
from .proc import TestbedError


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register the `testbed` command on the main CLI's subparsers."""
    p = subparsers.add_parser("testbed", help="the simulated Spark fleet (root)",
                              description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="testbed_cmd", required=True, metavar="{up,down,status,exec,restart,reset}")

    up = sub.add_parser("up", help="boot a fresh simulated fleet (removes any earlier one)")
    up.add_argument("--hosts", type=int, default=3, help="number of hosts (spark-1..N), default 3")
    up.add_argument("--switch", action="append", default=[], metavar="HOST:KEY[=VALUE]",
                    help="simulated hardware switch: gpu=NAME, compute_cap=X.Y, arch=x86_64, "
                         "disk_full, no_nvidia_runtime (repeatable)")
    up.add_argument("--login", choices=login.LOGINS, default=login.DEFAULT_LOGIN,
                    help=f"root, or dgx: a password-sudo user '{login.LOGIN_USER}' and no root SSH, as on DGX OS "
                         f"(default {login.DEFAULT_LOGIN})")
    up.add_argument("--names", choices=login.NAMES, default=login.DEFAULT_NAMES,
                    help="plain (inventory names with addresses), or alias: <name>.local names that only the "
                         f"controller resolves, through a generated ssh_config (default {login.DEFAULT_NAMES})")
    up.add_argument("--pairs", type=int, default=0,
                    help="join spark-1 + spark-2, spark-3 + spark-4, ... by a simulated ConnectX-7 link (default 0)")
    up.add_argument("--unpinned", action="store_true",
                    help="declare the image by its tag and every repository at main, as a real fleet is "
                         "(sparkfleet.lock then resolves them); default: pinned by digest and commit")
    up.add_argument("--bandwidth-scale", type=float, default=None, metavar="F",
                    help="shape the fleet like a real one, every rate divided by F: WAN (hub, registry) 1 Gb/s, "
                         "each host's NIC 10 Gb/s both ways, a pair's ConnectX-7 200 Gb/s (default: unshaped)")
    up.add_argument("--artifact-scale", type=float, default=None, metavar="S",
                    help="pad the image and the hub's checkpoints to their real sizes divided by S "
                         "(default: as small as they are)")
    up.add_argument("--keep-on-failure", action="store_true", help="leave a failed fleet for inspection")
    up.set_defaults(func=_handled(_cmd_up))

    down = sub.add_parser("down", help="remove the fleet (the cache stays)")
    down.set_defaults(func=_handled(_cmd_down))

    st = sub.add_parser("status", help="hosts, PIDs, addresses, SSH and services")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=_handled(_cmd_status))

    ex = sub.add_parser("exec", help="run a command on a host over SSH")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    ex.add_argument("--nsenter", action="store_true", help="enter the container instead of SSH")
    ex.set_defaults(func=_handled(_cmd_exec))

    rs = sub.add_parser("restart", help="reboot a host (stop its container, boot it again)")
    rs.add_argument("host")
    rs.set_defaults(func=_handled(_cmd_restart))

    hr = sub.add_parser("reset", help="hard-reset a host: kernel errors to its journal, power cut, boot again")
    hr.add_argument("host")
    hr.add_argument("--kernel-error", action="append", default=[], metavar="LINE",
                    help="a line the kernel logs before the reset (e.g. an NVIDIA Xid); repeatable")
    hr.set_defaults(func=_handled(_cmd_reset))
    p.set_defaults(func=lambda a: p.print_help() or 2)
    return p


def _handled(fn):
    """Wrap a command so a TestbedError prints as a message with exit 1, whichever CLI
    (sparkfleet's main or this module's) dispatches it."""
    def call(args: argparse.Namespace) -> int:
        try:
            return int(fn(args) or 0)
        except TestbedError as exc:
            print(f"sparkfleet testbed: error: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("sparkfleet testbed: interrupted", file=sys.stderr)
            return 130
    return call


def _cmd_up(args: argparse.Namespace) -> int:
    from . import fleet, paths, switches

    names = [paths.host_name(i) for i in range(1, args.hosts + 1)]
    try:
        sw = switches.parse_specs(args.switch, names)
    except ValueError as exc:
        raise TestbedError(str(exc)) from None
    tb = fleet.up(args.hosts, sw, keep_on_failure=args.keep_on_failure, login_kind=args.login, names=args.names,
                  n_pairs=args.pairs, pinned=not args.unpinned, bandwidth_scale=args.bandwidth_scale,
                  artifact_scale=args.artifact_scale)
    _print_status(tb.status())
    print(f"\ninventory: {tb.inventory_path.relative_to(paths.REPO_ROOT)}  (hosts: {tb.hosts_json})")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    from . import fleet

    fleet.down()
    return 0


def _print_status(st: dict) -> None:
    print(f"{'HOST':<10} {'PID':>8}  {'ADDRESS':<14} {'SSH':<4} {'SYSTEMD':<10} {'DOCKER':<9} SWITCHES")
    for h in st["hosts"]:
        sw = ",".join(f"{k}={v}" if v is not True else k for k, v in sorted(h["switches"].items())) or "-"
        print(f"{h['name']:<10} {h['pid'] or '-':>8}  {h['address']:<14} {'yes' if h['ssh'] else 'no':<4} "
              f"{h['system']:<10} {h['docker']:<9} {sw}")
    print()
    print(f"{'SERVICE':<10} {'PID':>8}  URL")
    for s in st["services"]:
        print(f"{s['name']:<10} {s['pid'] or 'DOWN':>8}  {s['url']}")
    if st.get("image"):
        print(f"\nimage: {st['image']}")


def _cmd_status(args: argparse.Namespace) -> int:
    from . import fleet

    st = fleet.status()
    if st is None:
        print("no testbed is up (sparkfleet testbed up --hosts N)")
        return 1
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        _print_status(st)
    healthy = all(h["pid"] and h["ssh"] for h in st["hosts"]) and all(s["pid"] for s in st["services"])
    return 0 if healthy else 1


def _cmd_exec(args: argparse.Namespace) -> int:
    from . import fleet

    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not cmd:
        raise TestbedError("exec: no command given")
    cp = fleet.load().exec(args.host, cmd if len(cmd) > 1 else cmd[0],
                           via="nsenter" if args.nsenter else "ssh", timeout=600)
    sys.stdout.write(cp.stdout)
    sys.stderr.write(cp.stderr)
    return cp.returncode


def _cmd_restart(args: argparse.Namespace) -> int:
    from . import fleet

    fleet.load().restart_host(args.host)
    return 0


def _cmd_reset(args: argparse.Namespace) -> int:
    from . import fleet

    fleet.load().hard_reset(args.host, kernel_errors=args.kernel_error)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry point: `python -m sparkfleet.testbed.cli up --hosts 3`."""
    parser = argparse.ArgumentParser(prog="sparkfleet")
    add_parser(parser.add_subparsers(dest="cmd", required=True))
    args = parser.parse_args(["testbed", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
