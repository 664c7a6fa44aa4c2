"""sparkfleet.lock on a fleet declared as a real one is: the image by its tag, every
repository at ``main`` (``up(pinned=False)``), while upstream moves under it.

In file order, on a fleet of its own: the first deploy (two hosts) resolves the tag and the
branches once and writes the lock; upstream moves ``main`` and the tag, and the converged
fleet changes nothing; upstream deletes the locked commit and manifest, and a host added
then (spark-3) deploys the locked bytes from the mirror; ``--data fleet_lock_update=all`` shows
(``--dry``) and then rolls the new bytes through the gate, host by host; a pair whose
members cached different commits of ``main`` before the lock is refused, naming both.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import requests
from support.failures import changes

from sparkfleet import lockfile
from sparkfleet.image import one_shot
from sparkfleet.profiles import INTEL_INT4, PROFILES
from sparkfleet.testbed import paths
from sparkfleet.testbed.hubservice import REPOS_DIR
from tests.e2e.conftest import REPO_ROOT, module_fleet, run_pyinfra

DRAFTER = PROFILES["dense"].drafter
HYBRID = PROFILES["dense"].model
SERVE_ENV = "/etc/sparkfleet/serve.env"


@pytest.fixture(scope="module")
def tb():
    with module_fleet(3, pinned=False) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def seen() -> dict:
    """What the tests of this module found, in their order (commits, digests)."""
    return {}


def inventory(tb, names: list[str], **groups: list[str]) -> str:
    """An inventory of some of the fleet's hosts (and groups), as a file beside its hosts.json."""
    listed = [tb.inventory_name(n) for n in names]
    path = paths.HOSTS_JSON.with_name(f"inventory-{'-'.join(names)}{'-' + '-'.join(groups) if groups else ''}.py")
    path.write_text(
        "from pathlib import Path\n"
        "from sparkfleet.testbed.state import inventory_hosts\n"
        f"_all = inventory_hosts(Path({str(paths.HOSTS_JSON)!r}))\n"
        f"sparks = ([h for h in _all if h[0] in {listed!r}], {{}})\n"
        + "".join(f"{group} = {[tb.inventory_name(n) for n in members]!r}\n" for group, members in groups.items())
    )
    return str(path.relative_to(REPO_ROOT))


def deploy(inv: str, *args: str) -> tuple[int, str]:
    result = run_pyinfra("deploy.py", *args, inventory=inv)
    return result.returncode, result.stdout + result.stderr


def lock_of(tb) -> lockfile.FleetLock:
    return lockfile.read(Path(tb.data["fleet_lock_file"]))[0]


def upstream_main(tb, repo: str) -> str:
    return requests.get(f"{tb.hub_url}/api/models/{repo}/revision/main", timeout=10).json()["sha"]


def serving(tb, name: str) -> dict:
    """What a host's engine runs: its serve.env, the running image's digests, its start."""
    env = dict(line.split("=", 1) for line in tb.exec(name, f"cat {SERVE_ENV}").stdout.splitlines() if "=" in line)
    digests = tb.exec(name, "docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "
                            "$(docker inspect --format '{{.Image}}' sparkfleet-serve)").stdout.split()
    started = tb.exec(name, "systemctl show sparkfleet-serve -p ExecMainStartTimestampMonotonic --value").stdout
    return {"revision": env.get("SF_REVISION"), "drafter": json.loads(env["SF_SPECULATIVE_CONFIG"]).get("revision"),
            "digests": {d.split("@", 1)[1] for d in digests if "@" in d}, "started": started.strip()}


def test_the_first_deploy_resolves_each_reference_once_and_every_host_serves_it(tb, seen):
    seen.update(drafter=upstream_main(tb, DRAFTER), hybrid=upstream_main(tb, HYBRID), image=tb.image["digest"])
    code, out = deploy(inventory(tb, ["spark-1", "spark-2"]))
    assert code == 0, out[-4000:]
    assert re.search(rf"--> Fleet lock: {re.escape(tb.data['fleet_lock_file'])} \(new", out), out[-4000:]
    assert f"+ {DRAFTER}@main: {seen['drafter'][:12]}" in out
    lock = lock_of(tb)
    assert lock.get(f"{DRAFTER}@main").pin == seen["drafter"] and lock.get(f"{HYBRID}@main").pin == seen["hybrid"]
    assert lock.get(tb.data["image"]).pin == seen["image"]
    for name in ("spark-1", "spark-2"):
        now = serving(tb, name)
        assert (now["revision"], now["drafter"]) == (seen["hybrid"], seen["drafter"]) and seen["image"] in now["digests"]
    # The testbed's lock lives in its state, never in the checkout.
    status = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=all"], cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.splitlines()
    assert [line for line in status if line.endswith("sparkfleet.lock") and "tests/fixtures/" not in line] == []


def test_upstream_moving_its_branch_and_tag_changes_nothing_on_a_converged_fleet(tb, seen):
    seen.update(drafter2=tb.hub_move(DRAFTER), image2=tb.registry_move())
    assert upstream_main(tb, DRAFTER) == seen["drafter2"]
    before = {n: serving(tb, n) for n in ("spark-1", "spark-2")}
    text = Path(tb.data["fleet_lock_file"]).read_text()
    code, out = deploy(inventory(tb, ["spark-1", "spark-2"]))
    assert code == 0 and changes(out) == [], out[-4000:]
    assert "--> Fleet lock" not in out and Path(tb.data["fleet_lock_file"]).read_text() == text
    assert {n: serving(tb, n) for n in ("spark-1", "spark-2")} == before


def test_a_host_added_after_upstream_deleted_the_locked_bytes_deploys_them_from_the_mirror(tb, seen):
    tb.hub_delete(DRAFTER, seen["drafter"])  # main moved on; the locked commit is force-pushed away
    tb.registry_delete(seen["image"])  # and the locked image's manifest deleted
    before = {n: serving(tb, n) for n in ("spark-1", "spark-2")}
    code, out = deploy(inventory(tb, ["spark-1", "spark-2", "spark-3"]))
    assert code == 0, out[-4000:]
    added = serving(tb, "spark-3")
    assert (added["revision"], added["drafter"]) == (seen["hybrid"], seen["drafter"])
    assert seen["image"] in added["digests"] and seen["image2"] not in added["digests"]
    # The mirror holds every file of a locked commit, so its HF mirror answers from its cache;
    # where it asks upstream first, the fetch falls back to the offline side and says so.
    said = [line for line in out.splitlines() if "is gone from" in line]
    assert all(re.search(rf"\[spark-3(?:\.local)?\] fetch-\S+: {DRAFTER}@{seen['drafter']} is gone from \S+ "
                         r"\(RevisionNotFoundError\): fetching it from the mirror's cache", line) for line in said), said
    assert {n: serving(tb, n) for n in ("spark-1", "spark-2")} == before


def test_an_explicit_update_shows_then_rolls_the_new_bytes_through_the_gate(tb, seen):
    inv = inventory(tb, ["spark-1", "spark-2", "spark-3"])
    text = Path(tb.data["fleet_lock_file"]).read_text()
    before = {n: serving(tb, n) for n in ("spark-1", "spark-2", "spark-3")}
    moves = (f"~ {DRAFTER}@main: {seen['drafter'][:12]} -> {seen['drafter2'][:12]}",
             f"~ image {tb.data['image']}: {seen['image'][:19]} -> {seen['image2'][:19]}")
    code, out = deploy(inv, "--data", "fleet_lock_update=all", "--dry")
    assert code == 0 and all(move in out for move in moves), out[-4000:]
    assert "the deploy would write it when it runs" in out
    assert Path(tb.data["fleet_lock_file"]).read_text() == text
    assert {n: serving(tb, n) for n in before} == before

    code, out = deploy(inv, "--data", "fleet_lock_update=all")
    assert code == 0 and all(move in out for move in moves), out[-4000:]
    lock = lock_of(tb)
    assert (lock.get(f"{DRAFTER}@main").pin, lock.get(tb.data["image"]).pin) == (seen["drafter2"], seen["image2"])
    for name in before:  # each host held the bytes the lock named before: it says so, and fetches the new
        assert re.search(rf"\[{name}(?:\.local)?\] holds {DRAFTER} at {seen['drafter'][:12]}, not the "
                         rf"{seen['drafter2'][:12]} sparkfleet.lock names: fetching that", out), out[-4000:]
    batches = dict(re.findall(r"\[(spark-\d)(?:\.local)?\] rolls in batch (\d)", out))
    assert batches == {"spark-1": "1", "spark-2": "2", "spark-3": "3"}, out[-4000:]
    assert len(re.findall(r"\[spark-\d(?:\.local)?\] gate passed", out)) == 3, out[-4000:]
    for name in before:
        now = serving(tb, name)
        assert now["drafter"] == seen["drafter2"] and seen["image2"] in now["digests"]
        assert now["started"] != before[name]["started"]
    # The mirror keeps the previous bytes too (mirror_keep_previous=1): a rollback needs them.
    kept = json.loads(tb.exec("spark-1", "cat /var/lib/sparkfleet/mirror/kept.json").stdout)
    assert [a["pin"] for a in kept[f"model {DRAFTER}"]] == [seen["drafter2"], seen["drafter"]]
    assert [a["pin"] for a in kept[f"image {paths.IMAGE_REPO}"]] == [seen["image2"], seen["image"]]
    # The hosts held the new commit's unchanged files already and never asked the mirror for
    # them; it asked itself: it holds every file of it, for a host added once upstream deletes it.
    files = f"/var/lib/sparkfleet/mirror/hf/repos/files/models/{DRAFTER}/resolve/{seen['drafter2']}"
    held = tb.exec("spark-1", f"ls {files}").stdout.split()
    assert sorted(held) == sorted(p.name for p in (REPOS_DIR / DRAFTER / seen["drafter2"]).rglob("*") if p.is_file())
    code, again = deploy(inv)
    assert code == 0 and changes(again) == [], again[-4000:]


def test_a_pair_whose_members_cached_different_commits_is_refused_naming_both(tb, seen):
    """Before the lock, each member downloaded main on its own day (fetch_weights.py, as every
    deploy ran it); the reference enters the lock now (profile base: the Intel checkpoint)."""
    image = f"localhost/sparkfleet/serve:{seen['image2'].replace(':', '-')}"

    def fetch_main(name: str) -> None:
        command = one_shot(image, "/var/lib/sparkfleet/hf", tb.hub_url, "sparkfleet-prelock-fetch",
                           f"/host/fetch_weights.py {INTEL_INT4} --revision main")
        done = tb.exec(name, command, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr

    fetch_main("spark-1")
    first = upstream_main(tb, INTEL_INT4)
    moved = tb.hub_move(INTEL_INT4)
    fetch_main("spark-2")
    text = Path(tb.data["fleet_lock_file"]).read_text()
    code, out = deploy(inventory(tb, ["spark-1", "spark-2", "spark-3"], pair_a=["spark-1", "spark-2"]),
                       "--data", "profile=base")
    assert code != 0
    assert f"{INTEL_INT4}@main: the hosts hold different commits of it" in out, out[-4000:]
    assert re.search(rf"{first[:12]} on spark-1(?:\.local)? \(pair_a\); {moved[:12]} on spark-2(?:\.local)? "
                     r"\(pair_a\)", out) or re.search(rf"{moved[:12]} on spark-2(?:\.local)? \(pair_a\); {first[:12]} "
                                                      r"on spark-1(?:\.local)? \(pair_a\)", out), out[-4000:]
    assert "nothing was changed on any host" in out and Path(tb.data["fleet_lock_file"]).read_text() == text
