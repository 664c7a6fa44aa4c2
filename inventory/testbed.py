"""pyinfra inventory of the simulated fleet, read from .testbed/hosts.json (that of
instance N with SPARKFLEET_TESTBED_INSTANCE=N).

`sparkfleet testbed up --hosts N` writes that file; then

    pyinfra -y inventory/testbed.py deploy.py

deploys to the simulated Sparks over real SSH. The testbed's group-data overrides
(image pinned by digest, hub endpoint, apt repo, revisions, real artifact sizes) are
put in each host's data, so `--data key=value` still overrides them.
"""

from sparkfleet.testbed.paths import HOSTS_JSON as _HOSTS_FILE
from sparkfleet.testbed.state import inventory_hosts

if not _HOSTS_FILE.is_file():
    raise SystemExit(
        f"inventory/testbed.py: {_HOSTS_FILE} is missing: run `sparkfleet testbed up` first"
    )

sparks = (inventory_hosts(_HOSTS_FILE), {})
