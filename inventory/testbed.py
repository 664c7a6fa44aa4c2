"""pyinfra inventory of the simulated fleet, read from .testbed/hosts.json.

`sparkfleet testbed up --hosts N` writes that file; then

    pyinfra -y inventory/testbed.py deploy.py

deploys to the simulated Sparks over real SSH. The testbed's group-data overrides
(image pinned by digest, hub endpoint, apt repo, revisions, real artifact sizes) are
put in each host's data, so `--data key=value` still overrides them.
"""

import json
from pathlib import Path

_HOSTS_FILE = Path(__file__).resolve().parent.parent / ".testbed" / "hosts.json"

if not _HOSTS_FILE.is_file():
    raise SystemExit(
        f"inventory/testbed.py: {_HOSTS_FILE} is missing: run `sparkfleet testbed up` first"
    )

_doc = json.loads(_HOSTS_FILE.read_text())

sparks = (
    [
        (
            _h["name"],
            {
                "ssh_hostname": _h["address"],
                "ssh_user": "root",
                "ssh_key": _h["ssh_key"],
                "ssh_strict_host_key_checking": "no",
                "ssh_known_hosts_file": "/dev/null",
                **_doc.get("data", {}),
            },
        )
        for _h in _doc["hosts"]
    ],
    {},
)
