"""Two Sparks as one: four simulated hosts cabled as two pairs, each serving one model with
vLLM's multi-node tensor parallelism over its ConnectX-7 link, behind the fleet endpoint.

spark-1 + spark-2 are pair_1 (spark-1 the head), spark-3 + spark-4 pair_2. The tests run in
file order on one booted fleet: a mismatched pair is refused before anything changes; the
deploy brings both heads READY with the checks run on the heads and the endpoint over two
members; a converged re-run changes nothing; a worker's engine killed brings its pair back
without a deploy; a rolling change, and a stack upgrade, move each pair as one while the
other serves.

The fleet replaces the session's (same testbed instance), so this module sorts after every
module on the session's fleet.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from sparkfleet.config import project_defaults
from sparkfleet.hostpaths import CONTAINER, LINK_CHECK
from sparkfleet.testbed import aptrepo, paths, simhw, traffic
from tests.e2e.conftest import module_fleet

pytestmark = pytest.mark.e2e

PAIRS = {"spark-1": ("spark-2",), "spark-3": ("spark-4",)}  # head: its workers
HEADS, WORKERS = tuple(PAIRS), ("spark-2", "spark-4")
LINK = {"spark-1": "192.168.100.1", "spark-2": "192.168.100.2", "spark-3": "192.168.100.1",
        "spark-4": "192.168.100.2"}
SERVE_ENV = "/etc/sparkfleet/serve.env"


@pytest.fixture(scope="module")
def pairs4():
    with module_fleet(4, n_pairs=2) as tb:
        yield tb


def data(tb) -> tuple[str, ...]:
    return ("--data", f"fleet_endpoint={tb.inventory_name('spark-1')}")


def started_at(tb, name: str) -> str:
    return tb.exec(name, "systemctl show sparkfleet-serve -p ExecMainStartTimestampMonotonic --value").stdout.strip()


def restarts(tb, name: str) -> int:
    return int(tb.exec(name, "systemctl show sparkfleet-serve -p NRestarts --value").stdout.strip() or 0)


def env_of(tb, name: str) -> dict[str, str]:
    text = tb.exec(name, f"cat {SERVE_ENV}").stdout
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def watcher(tb) -> traffic.Watch:
    return traffic.Watch(traffic.Endpoint(tb, "spark-1", tb.api_key_file))


def answers(tb, head: str) -> bool:
    """The pair answers a real request at its head (from the controller)."""
    ep = traffic.Endpoint(tb, head, tb.api_key_file)
    try:
        r = ep.http.post(f"http://{tb.host(head).address}:8000/v1/completions", headers=ep.auth,
                         json={"model": "qwen", "prompt": "The capital of France is", "max_tokens": 4}, timeout=10)
        return r.status_code == 200
    except Exception:  # noqa: BLE001 - not up (yet)
        return False


def out_of(result) -> str:
    return (result.stdout + result.stderr)[-6000:]


def full(result) -> str:
    return result.stdout + result.stderr


def test_a_pair_whose_members_differ_is_refused_naming_both(pairs4, deploy_run, tmp_path):
    inventory = tmp_path / "mismatched.py"
    inventory.write_text(
        "from pathlib import Path\n"
        "from sparkfleet.testbed.state import inventory_hosts, inventory_pairs\n"
        f"_json = Path({str(pairs4.hosts_json)!r})\n"
        f"sparks = ([(n, {{**d, 'profile': 'dflash'}} if n == {pairs4.inventory_name('spark-4')!r} else d)\n"
        "           for n, d in inventory_hosts(_json)], {})\n"
        "globals().update(inventory_pairs(_json))\n")
    proc = deploy_run("deploy.py", inventory=str(inventory))
    out = out_of(proc)
    assert proc.returncode != 0
    s3, s4 = pairs4.inventory_name("spark-3"), pairs4.inventory_name("spark-4")
    assert f"pair_2: {s3} and {s4} differ in `profile` ('dense' vs 'dflash')" in out, out
    assert "nothing was changed on any host" in out
    for name in pairs4.names:  # nothing was touched: no unit anywhere
        assert pairs4.exec(name, f"test -e {SERVE_ENV}").returncode != 0


def test_two_pairs_serve_at_their_heads_behind_one_endpoint(pairs4, deploy_run, tmp_path):
    proc = deploy_run("deploy.py", *data(pairs4), "--data", "checks=smoke,tools", "--data", f"results_dir={tmp_path}",
                      "--data", "run_id=pairs")
    out = out_of(proc)
    assert proc.returncode == 0, out
    for head, workers in PAIRS.items():
        env = env_of(pairs4, head)
        assert (env["SF_NODE_RANK"], env["SF_HEADLESS"], env["SF_NNODES"]) == ("0", "0", "2")
        for worker in workers:
            wenv = env_of(pairs4, worker)
            assert (wenv["SF_NODE_RANK"], wenv["SF_HEADLESS"]) == ("1", "1")
            assert wenv["SF_MASTER_ADDR"] == LINK[head] and wenv["VLLM_HOST_IP"] == LINK[worker]
            assert wenv["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1" and wenv["NCCL_IB_HCA"] == "rocep1s0f1,roceP2p1s0f1"
            # The pinned 0.23 image: eager, no custom all-reduce (vLLM #46253); RoCE v2 GID of the address.
            assert (wenv["SF_ENFORCE_EAGER"], wenv["SF_DISABLE_CUSTOM_ALL_REDUCE"]) == ("1", "1")
            assert wenv["NCCL_IB_GID_INDEX"] == "3"
            # The worker joined its head over the link, from its own link address.
            logs = pairs4.exec(head, f"docker logs {CONTAINER} 2>&1").stdout
            assert f"node_rank 1 joined from {LINK[worker]}" in logs, logs[-2000:]
            assert f"rank 1 of pair_{HEADS.index(head) + 1} (headless)" in proc.stdout + proc.stderr, out
        assert answers(pairs4, head)
        for member in (head, *workers):  # the link check's record: NCCL over RoCE, above NVIDIA's floor
            rec = json.loads(pairs4.exec(member, f"cat {LINK_CHECK}").stdout)
            assert (rec["ok"], rec["transport"], rec["gid_index"], rec["mtu"]) == (True, "IB", 3, 9000), rec
            assert rec["busbw_gbs"] >= rec["floor_gbs"] == 21.875, rec
    # The checks ran on the heads only, and the endpoint routes to the two heads.
    results = {p.stem: json.loads(p.read_text()) for p in (tmp_path / "pairs").glob("spark-*.json")}
    assert {n: r["status"] for n, r in results.items()} == {pairs4.inventory_name(h): "ok" for h in HEADS}, results
    ep = watcher(pairs4).ep
    assert sorted(ep.states()) == sorted(HEADS), ep.states()
    reply = ep.client().completions.create(model="qwen", prompt="The capital of France is", max_tokens=4)
    assert reply.choices[0].text
    # spark-1, pair_1's head, is the fleet mirror: spark-2 routes the mirror's address over the
    # link and received the image there; the other pair uses the management network.
    mirror = pairs4.host("spark-1").address
    route = pairs4.exec("spark-2", f"ip -o route get {mirror}").stdout
    assert "dev enp1s0f1np1" in route and f"src {LINK['spark-2']}" in route, route
    assert "enp1s0f1np1" not in pairs4.exec("spark-4", f"ip -o route get {mirror}").stdout
    got = re.search(rf"\[{re.escape(pairs4.inventory_name('spark-2'))}\] image ([0-9.]+) MiB from the mirror",
                    proc.stdout + proc.stderr)
    assert got and float(got.group(1)) > 1, out
    rx = int(pairs4.exec("spark-2", "cat /sys/class/net/enp1s0f1np1/statistics/rx_bytes").stdout)
    assert rx >= float(got.group(1)) * 2**20, (rx, got.group(1))
    # spark-3 fetches from the mirror and is a relay for its partner: spark-4 routes spark-3's
    # address over their link and received the image from it there (mirror.relay_tree).
    relay = pairs4.host("spark-3").address
    route = pairs4.exec("spark-4", f"ip -o route get {relay}").stdout
    assert "dev enp1s0f1np1" in route and f"src {LINK['spark-4']}" in route, route
    got = re.search(rf"\[{re.escape(pairs4.inventory_name('spark-4'))}\] image ([0-9.]+) MiB from the mirror",
                    proc.stdout + proc.stderr)
    assert got and float(got.group(1)) > 1, out
    rx = int(pairs4.exec("spark-4", "cat /sys/class/net/enp1s0f1np1/statistics/rx_bytes").stdout)
    assert rx >= float(got.group(1)) * 2**20, (rx, got.group(1))


def test_status_shows_each_pair_ready_at_its_head(pairs4):
    from tests.e2e.conftest import INVENTORY

    proc = subprocess.run(["sparkfleet", "status", INVENTORY, "--json", "--data",
                           f"fleet_endpoint={pairs4.inventory_name('spark-1')}"],
                          cwd=paths.REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["host"]: r for r in json.loads(proc.stdout)["hosts"]}
    for rank, (head, workers) in enumerate(PAIRS.items(), 1):
        assert rows[pairs4.inventory_name(head)]["pair"] == f"pair_{rank} rank 0"
        assert rows[pairs4.inventory_name(head)]["endpoint"] == "UP"
        for worker in workers:
            row = rows[pairs4.inventory_name(worker)]
            assert (row["pair"], row["ready"], row["unit"]) == (f"pair_{rank} rank 1", True, "active"), row
            assert row["endpoint"] == f"via {pairs4.inventory_name(head)}"


def test_a_converged_rerun_changes_nothing(pairs4, deploy_run):
    before = {n: started_at(pairs4, n) for n in pairs4.names}
    proc = deploy_run("deploy.py", *data(pairs4))
    assert proc.returncode == 0, out_of(proc)
    assert {n: started_at(pairs4, n) for n in pairs4.names} == before
    assert "netplan apply" not in proc.stdout and "rolls in batch" not in proc.stdout


def test_graphs_below_the_floor_a_wrong_gid_and_mtu_fail_naming_them(pairs4, deploy_run):
    """Each refused before the engines restart: pair_enforce_eager off on the 0.23 image; a GID
    index that is not RoCE v2's; jumbo frames off. A default run then measures RoCE again."""
    before = {n: started_at(pairs4, n) for n in pairs4.names}
    graphs = full(deploy_run("deploy.py", *data(pairs4), "--data", "pair_enforce_eager=False"))
    assert "would serve without --enforce-eager (pair_enforce_eager=False)" in graphs, graphs[-4000:]
    assert "vLLM 0.23.0 with NCCL 2.27.7, below the cross-node CUDA graph floor" in graphs, graphs[-4000:]
    gid = deploy_run("deploy.py", *data(pairs4), "--data", "pair_gid_index=1")
    said = full(gid)
    assert gid.returncode != 0 and re.search(r"NET/Socket, not RoCE, at \d+(\.\d+)? GB/s", said), said[-4000:]
    assert "NCCL_IB_GID_INDEX=1, but this host's RoCE v2 GID of 192.168.100.2 is index 3" in said, said[-4000:]
    mtu = full(deploy_run("deploy.py", *data(pairs4), "--data", "pair_mtu=1500"))
    assert "MTU 1500 on enp1s0f1np1 (pair_mtu)" in mtu and "pair_mtu=9000" in mtu, mtu[-4000:]
    assert {n: started_at(pairs4, n) for n in pairs4.names} == before
    healthy = deploy_run("deploy.py", *data(pairs4))
    assert healthy.returncode == 0 and "RoCE, all_gather 23 GB/s (floor 21.875)" in full(healthy), full(healthy)


def test_a_killed_worker_engine_brings_its_pair_back_without_a_deploy(pairs4):
    head, worker = "spark-1", "spark-2"
    before = {n: restarts(pairs4, n) for n in (head, worker)}
    assert pairs4.exec(worker, f"docker kill {CONTAINER}").returncode == 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        if all(restarts(pairs4, n) > before[n] for n in (head, worker)) and answers(pairs4, head):
            break
        time.sleep(2)
    # No half left behind: the head's engine failed with its worker (NCCL) and both restarted.
    assert restarts(pairs4, head) > before[head], pairs4.exec(head, "journalctl -u sparkfleet-serve -n 30").stdout
    assert restarts(pairs4, worker) > before[worker]
    assert answers(pairs4, head), pairs4.exec(head, f"docker logs {CONTAINER} 2>&1 | tail -20").stdout


def test_a_rolling_change_moves_each_pair_as_one(pairs4, deploy_run):
    before = {n: started_at(pairs4, n) for n in pairs4.names}
    with watcher(pairs4) as watch:
        proc = deploy_run("deploy.py", *data(pairs4), "--data", "max_num_seqs=4")
    out = out_of(proc)
    assert proc.returncode == 0, out
    for head, workers in PAIRS.items():
        assert re.search(rf"\[{re.escape(pairs4.inventory_name(head))}\] rolls in batch \d of 2 with "
                         rf"{re.escape(pairs4.inventory_name(workers[0]))}", proc.stdout + proc.stderr), out
        assert f"[{pairs4.inventory_name(workers[0])}] rolled with its head" in proc.stdout + proc.stderr, out
        for name in (head, *workers):
            assert started_at(pairs4, name) != before[name], name
            assert env_of(pairs4, name)["SF_MAX_NUM_SEQS"] == "4"
    # One pair out of rotation at a time: the other head served throughout.
    full = [s for _, s in watch.samples if len(s) == 2]
    assert full and all("UP" in s.values() for s in full), [s for s in full if "UP" not in s.values()]
    for head in HEADS:
        assert any(s[head] != "UP" for s in full), f"{head} never left the rotation"
    # Back to the defaults for whatever runs next.
    assert deploy_run("deploy.py", *data(pairs4)).returncode == 0


def test_a_stack_upgrade_moves_each_pair_as_one(pairs4, deploy_run):
    """The vendor's good toolkit declared: each pair changes in its head's turn, both members
    at once (its engine spans them), READY and gated at its head (its link measured again
    at both ends) while the other pair serves; no client request through the endpoint fails."""
    keyring, sources = "/etc/apt/keyrings/sparkfleet-sim-stack.asc", "/etc/apt/sources.list.d/sparkfleet-sim-stack.list"
    url, toolkit, good = aptrepo.STACK_URL, simhw.TOOLKIT_PACKAGE, aptrepo.STACK_GOOD_TOOLKIT
    wanted = project_defaults()["stack_versions"]
    wanted["toolkit"] = {**wanted["toolkit"], toolkit: good}
    for name in pairs4.names:  # the vendor's later releases reach every host's apt sources
        done = pairs4.exec(name, f"install -d /etc/apt/keyrings && curl -fsSL {url}gpgkey -o {keyring} && "
                           f"echo 'deb [signed-by={keyring}] {url} /' > {sources} && apt-get update -qq && echo ok",
                           timeout=120)
        assert done.stdout.strip().endswith("ok"), done.stdout + done.stderr
    before = {n: started_at(pairs4, n) for n in pairs4.names}
    ep = traffic.Endpoint(pairs4, "spark-1", pairs4.api_key_file)
    try:
        with watcher(pairs4) as watch, traffic.Load(ep, workers=2) as load:
            proc = deploy_run("deploy.py", *data(pairs4), "--data", f"stack_versions={json.dumps(wanted)}")
        out = full(proc)
        assert proc.returncode == 0, out_of(proc)
        for head, workers in PAIRS.items():
            assert f"[{pairs4.inventory_name(workers[0])}] rolled with its head" in out, out_of(proc)
            for name in (head, *workers):
                # The gate measured the pair's link again on the new toolkit, at both ends.
                assert re.search(rf"\[{re.escape(pairs4.inventory_name(name))}\] NCCL over \S+: RoCE, all_gather",
                                 out), out_of(proc)
                have = pairs4.exec(name, f"dpkg-query -W -f='${{Version}}' {toolkit}").stdout.strip()
                assert have == good and started_at(pairs4, name) != before[name], (name, have)
        both = [s for _, s in watch.samples if len(s) == 2]
        assert both and all("UP" in s.values() for s in both), [s for s in both if "UP" not in s.values()]
        print(f"pairs' stack upgrade: {load.ok} requests ok, {len(load.failed)} failed")
        assert load.ok > 0 and load.failed == [], load.failed[:5]
    finally:
        for name in pairs4.names:
            pairs4.exec(name, f"rm -f {sources} {keyring}; apt-get update -qq", timeout=180)
