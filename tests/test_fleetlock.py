"""sparkfleet.lock without a fleet: the file (read, written, diffed, refused when broken),
what a run resolves and what it leaves alone, adoption of what hosts hold, pairs checked
on commits, and the controller's questions to a real hub (the testbed's, in-process)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from support.fleetdata import defaults, fake_state

import sparkfleet.upstream
from sparkfleet import fleetlock, lockfile
from sparkfleet.config import ConfigError, validate_host_data
from sparkfleet.fleetlock import Held
from sparkfleet.lockfile import Entry, FleetLock, LockError
from sparkfleet.upstream import Unresolved

REAL_UPSTREAM = sparkfleet.upstream.Upstream  # fake_state replaces it while a fake fleet plans
IMAGE = defaults()["image"]
HYBRID = "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid"
DRAFTER = "z-lab/Qwen3.5-122B-A10B-DFlash"
NOW = "2026-12-02T00:00:00Z"


def sha(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()


class Upstream:
    """Answers as upstream is now (``commits``/``digests``), counting every question."""

    def __init__(self, commits: dict[str, str] | None = None, digests: dict[str, str] | None = None):
        self.commits = commits or {}
        self.digests = digests or {}
        self.asked: list[str] = []

    def model(self, endpoint, repo, revision, token):
        self.asked.append(f"{repo}@{revision}")
        if revision == "v9":
            raise Unresolved(f"{repo} has no revision 'v9' at {endpoint}", "set model_revisions to a branch")
        return self.commits.get(f"{repo}@{revision}", revision if len(revision) == 40 else sha(repo)), 2 << 30

    def image(self, registry_url, reference):
        self.asked.append(reference)
        return self.digests.get(reference, reference.partition("@")[2] or digest(reference)), 21 << 30


def hosts(n: int = 2, **data) -> dict:
    return {f"spark-{i}": validate_host_data(f"spark-{i}", {**defaults(), **data}) for i in range(1, n + 1)}


def nothing_held(names):
    raise AssertionError(f"asked what {names} hold, with every reference already locked")


def plan(settings, lock=None, update=(), held=lambda names: {}, upstream=None, pairs=None):
    return fleetlock.plan(settings, lock or FleetLock(), set(update), held, upstream or Upstream(), pairs, NOW)


# --- the file ---------------------------------------------------------------------------------


def test_the_file_reads_back_what_was_written_in_one_order_with_its_header(tmp_path):
    first = plan(hosts()).lock
    text = lockfile.render(first)
    assert text.startswith("# sparkfleet.lock: the bytes this fleet serves")
    assert lockfile.parse(text) == first
    # One order whatever order the entries came in: a diff of two locks shows what moved only.
    assert lockfile.render(FleetLock(dict(reversed(first.entries.items())))) == text
    assert text.index("[[image]]") < text.index(f'repo = "{HYBRID}"') < text.index(f'repo = "{DRAFTER}"')
    assert f'reference = "{IMAGE}"' in text and 'revision = "main"' in text and "# 2.00 GiB" in text
    path = tmp_path / "sparkfleet.lock"
    path.write_text(text)
    assert lockfile.read(path) == (first, text)
    assert lockfile.read(tmp_path / "none.lock") == (FleetLock(), None)


@pytest.mark.parametrize("text, needle", [
    ("version = [", "is not valid TOML"),
    ("version = 2\n", "version 2, this sparkfleet reads version 1"),
    ('version = 1\n[[model]]\nrepo = "a/b"\nrevision = "main"\ncommit = "abc"\n', "[[model]] #1 (a/b) needs"),
    ('version = 1\n[[image]]\nreference = "r:1"\ndigest = "sha256:12"\n', "[[image]] #1 (r:1) needs"),
    ("version = 1\n" + f'[[model]]\nrepo = "a/b"\nrevision = "main"\ncommit = "{"1" * 40}"\n' * 2,
     "names a reference twice"),
])
def test_a_broken_file_is_refused_naming_it_and_the_fix(text, needle, tmp_path):
    path = tmp_path / "sparkfleet.lock"
    path.write_text(text)
    with pytest.raises(LockError) as err:
        lockfile.read(path)
    assert needle in str(err.value) and str(path) in str(err.value)
    assert "nothing was changed on any host" in str(err.value)


def test_it_lives_beside_the_inventory_or_where_lock_file_says(tmp_path):
    inventory = tmp_path / "inventory" / "sparks.py"
    inventory.parent.mkdir()
    inventory.write_text("sparks = []\n")
    assert lockfile.lock_path(None, str(inventory)) == inventory.parent / "sparkfleet.lock"
    assert lockfile.lock_path(None, "spark-1,spark-2") == Path("sparkfleet.lock")  # a list of hosts: here
    assert lockfile.lock_path(None, None) == Path("sparkfleet.lock")
    assert lockfile.lock_path("~/fleet.lock", str(inventory)) == Path("~/fleet.lock").expanduser()


# --- what a run resolves ---------------------------------------------------------------------


def test_the_first_run_resolves_each_tag_and_branch_once_for_the_whole_fleet():
    upstream = Upstream()
    planned = plan(hosts(3), upstream=upstream)
    assert planned.problems == []
    assert sorted(upstream.asked) == sorted([IMAGE, f"{HYBRID}@main", f"{DRAFTER}@main"])  # once, for 3 hosts
    entry = planned.lock.get(f"{DRAFTER}@main")
    assert entry == Entry("model", DRAFTER, "main", sha(DRAFTER), 2 << 30, NOW, "https://huggingface.co")
    assert planned.lock.get(IMAGE).pin == digest(IMAGE) and planned.lock.get(IMAGE).source == "https://ghcr.io"
    assert any(line.startswith(f"    + {DRAFTER}@main: {sha(DRAFTER)[:12]} (2.00 GiB") for line in planned.changes)


def test_a_complete_lock_asks_nobody_and_changes_nothing_however_upstream_moved():
    first = plan(hosts()).lock
    moved = Upstream({f"{DRAFTER}@main": sha("retrained")}, {IMAGE: digest("rebuilt")})
    again = plan(hosts(), first, held=nothing_held, upstream=moved)
    assert again.lock == first and again.changes == [] and moved.asked == []


def test_an_update_resolves_again_what_it_names_and_says_old_to_new():
    first = plan(hosts()).lock
    moved = Upstream({f"{DRAFTER}@main": sha("retrained"), f"{HYBRID}@main": sha("hybrid 2")},
                     {IMAGE: digest("rebuilt")})
    one = plan(hosts(), first, [DRAFTER], upstream=moved)
    assert moved.asked == [f"{DRAFTER}@main"]
    assert one.lock.get(f"{DRAFTER}@main").pin == sha("retrained")
    assert one.lock.get(f"{HYBRID}@main") == first.get(f"{HYBRID}@main")
    assert one.changes == [f"    ~ {DRAFTER}@main: {sha(DRAFTER)[:12]} -> {sha('retrained')[:12]} (2.00 GiB -> 2.00 GiB)"]
    image = plan(hosts(), first, ["image"], upstream=moved)
    assert image.changes == [f"    ~ image {IMAGE}: {digest(IMAGE)[:19]} -> {digest('rebuilt')[:19]} "
                             "(21.00 GiB -> 21.00 GiB)"]
    every = plan(hosts(), first, ["all"], upstream=moved)
    assert len(every.changes) == 3
    unknown = plan(hosts(), first, ["acme/other"], upstream=moved)
    assert "`fleet_lock_update` names acme/other, which no host of the inventory serves" in unknown.problems[0]


def test_pinned_references_are_recorded_as_pinned_and_an_update_leaves_them():
    commit, pinned_image = "c" * 40, IMAGE + "@" + digest("pinned")
    settings = hosts(image=pinned_image, model_revisions={DRAFTER: commit})
    first = plan(settings).lock
    assert first.get(f"{DRAFTER}@{commit}").pin == commit and first.get(f"{DRAFTER}@{commit}").source == f"{commit} (pinned)"
    assert first.get(pinned_image).pin == digest("pinned")
    upstream = Upstream({}, {pinned_image: digest("other")})
    again = plan(settings, first, ["all"], upstream=upstream)
    assert again.lock.get(pinned_image) == first.get(pinned_image)
    assert again.lock.get(f"{DRAFTER}@{commit}") == first.get(f"{DRAFTER}@{commit}")
    assert upstream.asked == [f"{HYBRID}@main"]  # the one moving reference


def test_what_no_host_asks_for_leaves_the_lock_and_a_stopped_host_keeps_its_references():
    first = plan(hosts()).lock
    dflash = plan(hosts(profile="dflash"), first)
    assert f"    - {HYBRID}@main: {sha(HYBRID)[:12]} (no host asks for it)" in dflash.changes
    assert dflash.lock.get(f"{HYBRID}@main") is None
    assert dflash.lock.get("Intel/Qwen3.5-122B-A10B-int4-AutoRound@main") is not None
    assert plan(hosts(serving=False), first, held=nothing_held).changes == []


def test_upstream_that_cannot_answer_stops_the_run_with_the_fix():
    planned = plan(hosts(model_revisions={HYBRID: "v9"}))
    assert planned.problems == [f"{HYBRID}@v9: {HYBRID} has no revision 'v9' at https://huggingface.co. "
                                "Fix: set model_revisions to a branch"]


# --- adopting what a fleet deployed before the lock holds -------------------------------------------


def marker(repo: str, revision: str = "main") -> str:
    return f"{repo.replace('/', '--')}@{revision}"


def test_what_every_host_already_holds_is_adopted_so_the_lock_moves_nothing():
    held = {name: Held({marker(DRAFTER): sha("4 layers")}) for name in ("spark-1", "spark-2")}
    moved = Upstream({f"{DRAFTER}@main": sha("6 layers")})
    planned = plan(hosts(), held=lambda names: held, upstream=moved)
    entry = planned.lock.get(f"{DRAFTER}@main")
    assert entry.pin == sha("4 layers") and entry.source == "held by spark-1, spark-2"
    assert (f"    {DRAFTER}@main: upstream main is {sha('6 layers')[:12]} now; --data fleet_lock_update={DRAFTER} "
            "moves the fleet to it") in planned.changes
    assert planned.lock.get(f"{HYBRID}@main").source == "https://huggingface.co"  # nobody held it


def test_hosts_that_hold_different_commits_are_refused_naming_each():
    held = {"spark-1": Held({marker(DRAFTER): sha("4 layers")}), "spark-2": Held({marker(DRAFTER): sha("6 layers")})}
    planned = plan(hosts(3), held=lambda names: held, pairs={"spark-1": "pair_a", "spark-2": "pair_a"})
    problem, = planned.problems
    assert f"{DRAFTER}@main: the hosts hold different commits of it" in problem
    assert f"{sha('4 layers')[:12]} on spark-1 (pair_a)" in problem and f"{sha('6 layers')[:12]} on spark-2 (pair_a)" in problem
    assert "pair_a must load the same bytes on every member" in problem
    assert f"--data fleet_lock_update={DRAFTER}" in problem
    # Moving it on purpose takes upstream's, whatever the hosts hold.
    assert plan(hosts(3), update=[DRAFTER], held=lambda names: held).problems == []


def test_an_image_the_hosts_pulled_by_its_tag_is_adopted_by_digest():
    from sparkfleet.hostpaths import local_image

    held = {"spark-1": Held(images={local_image(IMAGE): [digest("pulled in May")]})}
    planned = plan(hosts(), held=lambda names: held)
    assert planned.lock.get(IMAGE).pin == digest("pulled in May")


# --- what the hosts serve ------------------------------------------------------------------------------


def test_locked_settings_serve_the_commit_and_the_digest_everywhere():
    settings = hosts(1)["spark-1"]
    lock = plan({"spark-1": settings}).lock
    served = fleetlock.locked(settings, lock)
    assert served.image == f"{IMAGE}@{digest(IMAGE)}"
    env = served.serve_env()
    assert env["SF_REVISION"] == sha(HYBRID)
    assert f'"revision":"{sha(DRAFTER)}"' in env["SF_SPECULATIVE_CONFIG"]
    pinned = settings.model_copy(update={"image": f"{IMAGE}@{digest('mine')}"})
    assert fleetlock.locked(pinned, lock).image == pinned.image  # a digest is what it is


def test_a_pair_is_checked_on_commits_not_on_the_names_asked():
    from sparkfleet import fleet

    pair = ["@fake/spark-1", "@fake/spark-2"]
    # One asks main, the other the commit main resolves to (tests/support: StubUpstream): one engine.
    same = [(pair[0], {}), (pair[1], {"model_revisions": {HYBRID: sha(f"{HYBRID}@main")}})]
    with fake_state(same, pair_a=pair) as state:
        settings = fleet._planned(state)["settings"]
    assert settings[pair[0]].serve_env()["SF_REVISION"] == settings[pair[1]].serve_env()["SF_REVISION"]
    other = [(pair[0], {}), (pair[1], {"model_revisions": {HYBRID: "f" * 40}})]
    with fake_state(other, pair_a=pair) as state, pytest.raises(ConfigError) as err:
        fleet._planned(state)
    assert "pair_a: @fake/spark-1 and @fake/spark-2 differ in `model@revision`" in str(err.value)
    assert f"{sha(f'{HYBRID}@main')}" in str(err.value) and "f" * 40 in str(err.value)


def test_a_pair_whose_caches_differ_is_refused_naming_both_commits():
    from sparkfleet import fleet

    pair = ["@fake/spark-1", "@fake/spark-2"]
    # A fleet deployed before the lock: each member downloaded main on its own day.
    held = [(name, {"fake_responses": {"sparkfleet/complete": [f"marker {marker(DRAFTER)} {commit}"]}})
            for name, commit in zip(pair, (sha("4 layers"), sha("6 layers")))]
    with fake_state(held, pair_a=pair) as state, pytest.raises(ConfigError) as err:
        fleet._planned(state)
    assert f"{sha('4 layers')[:12]} on @fake/spark-1 (pair_a)" in str(err.value)
    assert f"{sha('6 layers')[:12]} on @fake/spark-2 (pair_a)" in str(err.value)
    assert "nothing was changed on any host" in str(err.value)


# --- the controller asks the hub ---------------------------------------------------------------------


def test_the_hub_is_asked_for_a_branch_s_commit_and_its_size(tmp_path):
    from sparkfleet.testbed.hub import HubServer

    repo, first = "acme/drafter", "1" * 40
    (tmp_path / repo / first).mkdir(parents=True)
    (tmp_path / repo / first / "model.safetensors").write_bytes(b"x" * 1000)
    with HubServer(tmp_path, "127.0.0.1", 0) as hub:
        upstream = REAL_UPSTREAM(timeout=10)
        assert upstream.model(hub.url, repo, "main", None) == (first, 1000)
        moved = hub.move_ref(repo)
        commit, size = upstream.model(hub.url, repo, "main", None)
        assert (commit, size) == (moved, 1000 + len("2\n"))
        with pytest.raises(Unresolved) as err:
            upstream.model(hub.url, repo, "v9", None)
        assert "has no revision 'v9'" in str(err.value) and "model_revisions" in err.value.fix
        with pytest.raises(Unresolved, match="does not show acme/none"):
            upstream.model(hub.url, "acme/none", "main", None)
    with pytest.raises(Unresolved, match="the controller cannot reach") as err:
        REAL_UPSTREAM(timeout=10).model(hub.url, repo, "main", None)  # the hub is gone
    assert "sparkfleet.lock" in err.value.fix
