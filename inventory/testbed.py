"""pyinfra inventory of the simulated fleet, read from .testbed/hosts.json (that of
instance N with SPARKFLEET_TESTBED_INSTANCE=N).

`sparkfleet testbed up --hosts N` writes that file; then

    pyinfra -y inventory/testbed.py deploy.py

deploys to the simulated Sparks over real SSH. The testbed's group-data overrides
(image pinned by digest, hub endpoint, apt repo, revisions, real artifact sizes) are
put in each host's data, so `--data key=value` still overrides them.
"""

from pathlib import Path

from sparkfleet.testbed import paths as _paths
from sparkfleet.testbed.state import inventory_hosts, inventory_pairs

_HOSTS_FILE = Path(__file__).resolve().parent.parent / ".testbed" / _paths.HOSTS_JSON.relative_to(_paths.DOT_TESTBED)

if not _HOSTS_FILE.is_file():
    raise SystemExit(
        f"inventory/testbed.py: {_HOSTS_FILE} is missing: run `sparkfleet testbed up` first"
    )

sparks = (inventory_hosts(_HOSTS_FILE), {})
# A fleet up with --pairs: pair_1, pair_2, ... (the cabled hosts, head first).
globals().update(inventory_pairs(_HOSTS_FILE))
