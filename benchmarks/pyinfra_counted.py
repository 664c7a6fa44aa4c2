"""``pyinfra`` itself, counting what it asks of each host over SSH.

    python benchmarks/pyinfra_counted.py COUNTS.json [pyinfra arguments ...]

Runs pyinfra's own command line unchanged; on exit writes to COUNTS.json, per host
address: ``commands`` (exec channels opened: every fact, operation command and callback
run), ``peak_channels`` (the most channels open on that host's one connection at any
moment, the SFTP channel included: sshd refuses a session beyond ``MaxSessions``),
``refused`` (channel opens the host refused), and the process's own CPU seconds.
Nothing of a command's text is kept (it may carry a sudo password prompt's answer).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
from collections import defaultdict

import paramiko

COUNTS: dict[str, dict[str, int]] = defaultdict(lambda: {"commands": 0, "peak_channels": 0, "refused": 0})
_open_session = paramiko.Transport.open_session


def _counted_open_session(self, *args, **kwargs):
    peer = self.getpeername()[0]
    entry = COUNTS[peer]
    try:
        channel = _open_session(self, *args, **kwargs)
    except paramiko.ChannelException:
        entry["refused"] += 1
        raise
    entry["commands"] += 1  # an SFTP subsystem is one more; pyinfra opens it once per host
    entry["peak_channels"] = max(entry["peak_channels"], len(self._channels.values()))
    return channel


def _write(path: str) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(path, "w") as f:
        json.dump({"hosts": dict(COUNTS),
                   "cpu_s": usage.ru_utime + usage.ru_stime + children.ru_utime + children.ru_stime}, f, indent=1)


def main() -> int:
    out, sys.argv = sys.argv[1], ["pyinfra", *sys.argv[2:]]
    paramiko.Transport.open_session = _counted_open_session
    atexit.register(_write, os.path.abspath(out))
    from pyinfra_cli.main import main as pyinfra_main

    return pyinfra_main()


if __name__ == "__main__":
    sys.exit(main())
