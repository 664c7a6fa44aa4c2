"""A pair's preflight is the pair's: a member whose peer fails stops too, before it changes
anything, naming the peer and its problems; each host is judged once (no fleet: @fake
hosts, planned with --dry, and inspect() in a pyinfra state of its own)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
from pyinfra import host
from pyinfra.api import Config, Inventory, State
from pyinfra.api.connect import connect_all
from pyinfra.context import ctx_host, ctx_state
from support.fleetdata import StubUpstream, defaults

from sparkfleet import preflight

ROOT = Path(__file__).resolve().parents[1]


def plan(fleet: str, *args: str) -> str:
    """deploy.py planned on tests/fixtures/fake_pair.py (its first two hosts are pair_a)."""
    cmd = [sys.executable, "-m", "pyinfra", "--dry", *args, "tests/fixtures/fake_pair.py", "deploy.py"]
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "FAKE_FLEET": fleet}, capture_output=True, text=True,
                          timeout=120)
    return done.stdout + done.stderr


def planned(out: str, step: str) -> str:
    """``step``'s row in the plan's table of changes ("" when no host plans it)."""
    table = out.split("--> Detected changes:", 1)[-1]
    return next((line for line in table.splitlines() if step in line), "")


def test_a_member_whose_peer_fails_plans_only_its_failing_preflight():
    out = plan("gb10,full,gb10")
    row = planned(out, "preflight: GB10, aarch64, driver, docker, disk, memory")
    assert "spark-1-gb10" in row and "spark-2-full" in row and "spark-3-gb10" not in row, row
    # Nothing else on either member: no netplan, no image, no unit. The host alone goes on.
    assert planned(out, "/etc/netplan/40-cx7.yaml") == ""
    for step in ("serving image present", "serving settings (serve.env)", "systemd unit sparkfleet-serve.service"):
        row = planned(out, step)
        assert "spark-1" not in row and "spark-2" not in row and "spark-3-gb10" in row, row


def test_a_pair_whose_members_pass_plans_its_link_and_reads_each_hosts_facts_once():
    out = plan("gb10,gb10", "-vvv")  # -vvv: every fact's command, with its host
    assert "spark-1" not in planned(out, "preflight: GB10") and "spark-2" not in planned(out, "preflight: GB10")
    row = planned(out, "/etc/netplan/40-cx7.yaml")
    assert "spark-1-gb10" in row and "spark-2-gb10" in row, row
    gpu_reads = re.findall(r"\[(@fake/spark-\d-gb10)\] >>> .*nvidia-smi --query-gpu", out)
    assert sorted(gpu_reads) == ["@fake/spark-1-gb10", "@fake/spark-2-gb10"], gpu_reads


# --- inspect, in a state of its own ------------------------------------------------------------


@pytest.fixture()
def pair_state():
    names = ["@fake/spark-1", "@fake/spark-2", "@fake/spark-3"]
    inventory = Inventory((names, {**defaults(), "fake_delay": 0, "fake_delay_jitter": 0}),
                          pair_a=(names[:2], {}))
    state = State(inventory, Config())
    with ctx_state.use(state), mock.patch("sparkfleet.upstream.Upstream", StubUpstream):
        connect_all(state)
        yield state


def judge_from(problems: dict[str, list[str]], judged: list[str]):
    def judge(settings) -> preflight.Findings:
        judged.append(host.name)
        return preflight.Findings(problems=list(problems.get(host.name, [])), summary="checked")
    return judge


def inspected(state: State, name: str, judge) -> preflight.Findings:
    with ctx_host.use(state.inventory.get_host(name)):
        return preflight.inspect(settings=None, judge=judge)


def test_a_failing_peer_stops_the_member_and_each_host_is_judged_once(pair_state):
    judged: list[str] = []
    judge = judge_from({"@fake/spark-2": ["/ has 1.0 GiB free, 60.0 GiB needed: free space"]}, judged)
    head = inspected(pair_state, "@fake/spark-1", judge)
    assert not head.passed and head.problems == []
    assert head.peers == {"@fake/spark-2": ["/ has 1.0 GiB free, 60.0 GiB needed: free space"]}
    assert preflight.failure(head) == (
        "its pair peer @fake/spark-2 failed its preflight, so nothing was changed on this host (a pair serves "
        "only when every member can: fix @fake/spark-2, then deploy both):\n"
        "  - @fake/spark-2: / has 1.0 GiB free, 60.0 GiB needed: free space")
    worker = inspected(pair_state, "@fake/spark-2", judge)
    assert not worker.passed and worker.peers == {}  # its own problem, and a peer that passed
    assert preflight.failure(worker) == ("preflight failed, nothing was changed on this host:\n"
                                         "  - / has 1.0 GiB free, 60.0 GiB needed: free space")
    alone = inspected(pair_state, "@fake/spark-3", judge)
    assert alone.passed and alone.summary == "checked"  # a host that serves alone judges itself only
    assert sorted(judged) == ["@fake/spark-1", "@fake/spark-2", "@fake/spark-3"]


def test_both_failing_each_member_names_its_own_problems_then_its_peers(pair_state):
    judge = judge_from({"@fake/spark-1": ["no GPU"], "@fake/spark-2": ["no cable"]}, [])
    assert preflight.failure(inspected(pair_state, "@fake/spark-1", judge)) == (
        "preflight failed, nothing was changed on this host:\n  - no GPU\n"
        "its pair peer @fake/spark-2 failed its preflight too:\n  - @fake/spark-2: no cable")


def test_a_member_passes_only_with_every_peer_and_says_so(pair_state):
    found = inspected(pair_state, "@fake/spark-2", judge_from({}, []))
    assert found.passed and found.summary == "checked; pair_a: @fake/spark-1 passed too"


def test_a_peer_the_controller_cannot_reach_stops_the_member(pair_state):
    pair_state.activated_hosts.discard(pair_state.inventory.get_host("@fake/spark-2"))
    judged: list[str] = []
    found = inspected(pair_state, "@fake/spark-1", judge_from({}, judged))
    assert not found.passed and judged == ["@fake/spark-1"]  # no fact of the peer is read
    assert found.peers["@fake/spark-2"][0].startswith("the controller is not connected to it (unreachable")
