#!/usr/bin/python3
"""runc wrapper of the sparkfleet testbed, installed as /usr/sbin/runc (the real one is
diverted to /usr/sbin/runc.distrib). Stdlib only.

Not simulated hardware but a limit of the machine the testbed runs on: its processes
lack CAP_SYS_RESOURCE, so no process can raise the hard RLIMIT_MEMLOCK, and runc fails
any container asking for more (the deploy runs the serving container with
`--ulimit memlock=-1:-1`, as a real Spark needs). On `create`/`run` this clamps the
memlock limit in the bundle's config.json (on `exec`, in the process spec a `docker exec`
inherits it into) to the allowed maximum and logs it to
/run/sparkfleet-sim/runc-clamp.log; with CAP_SYS_RESOURCE it changes nothing.
"""

import json
import os
import resource
import sys

REAL = "/usr/sbin/runc.distrib"
LOG = "/run/sparkfleet-sim/runc-clamp.log"


def has_sys_resource() -> bool:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("CapEff:"):
                return bool(int(line.split()[1], 16) >> 24 & 1)  # CAP_SYS_RESOURCE = 24
    return False


def bundle_of(args: list[str]) -> str:
    for i, a in enumerate(args):
        if a in ("--bundle", "-b") and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--bundle="):
            return a.split("=", 1)[1]
    return "."


def clamp(cfg: dict, cap: int) -> bool:
    changed = False
    for rl in (cfg.get("process") or {}).get("rlimits") or []:
        if rl.get("type") == "RLIMIT_MEMLOCK" and rl.get("hard", 0) > cap:
            rl["hard"] = cap
            rl["soft"] = min(rl.get("soft", cap), cap)
            changed = True
    return changed


def process_file_of(args: list[str]) -> str | None:
    """`runc exec --process FILE` (docker exec): the process spec, rlimits at its top."""
    for i, a in enumerate(args):
        if a in ("--process", "-p") and i + 1 < len(args):
            return args[i + 1]
        if a.startswith("--process="):
            return a.split("=", 1)[1]
    return None


def clamp_exec(path: str, cap: int) -> None:
    try:
        with open(path) as f:
            process = json.load(f)
        if clamp({"process": process}, cap):
            with open(path + ".tmp", "w") as f:
                json.dump(process, f)
            os.replace(path + ".tmp", path)
    except (OSError, ValueError):
        pass  # let the real runc report whatever is wrong


def main(args: list[str]) -> None:
    if "exec" in args and process_file_of(args) and not has_sys_resource():
        cap = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        if cap != resource.RLIM_INFINITY:
            clamp_exec(process_file_of(args), cap)
    if any(a in ("create", "run") for a in args) and not has_sys_resource():
        cap = resource.getrlimit(resource.RLIMIT_MEMLOCK)[1]
        bundle = bundle_of(args)
        path = os.path.join(bundle, "config.json")
        try:
            with open(path) as f:
                cfg = json.load(f)
            if cap != resource.RLIM_INFINITY and clamp(cfg, cap):
                with open(path + ".tmp", "w") as f:
                    json.dump(cfg, f)
                os.replace(path + ".tmp", path)
                os.makedirs(os.path.dirname(LOG), exist_ok=True)
                with open(LOG, "a") as f:
                    f.write(f"{bundle}: RLIMIT_MEMLOCK clamped to {cap}\n")
        except (OSError, ValueError):
            pass  # let the real runc report whatever is wrong
    os.execv(REAL, [REAL, *args])


if __name__ == "__main__":
    main(sys.argv[1:])
