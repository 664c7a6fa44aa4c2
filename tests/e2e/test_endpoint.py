"""The fleet endpoint on three simulated Sparks: HAProxy on spark-1 over every host.

The tests run in file order on the session's fleet and build on each other's state: deploy
with the endpoint, call it with and without the key, break members and watch them leave
and rejoin the rotation, drain one through the runtime API, re-run converged, change the
membership by a reload under load. Timings and counts they measure are printed (-s).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from support.failures import changed_hosts, changes

from sparkfleet.haproxy import save_state_command
from sparkfleet.testbed import login, paths, traffic

pytestmark = pytest.mark.e2e

# Tests speak of hosts by their testbed names; the inventory (and so the endpoint's
# members, pyinfra's output and `sparkfleet status`) by what the session fleet's names are.
ROUTER = "spark-1"
ROUTER_NAME = login.inventory_name(ROUTER, login.DEFAULT_NAMES)
DATA = f"fleet_endpoint={ROUTER_NAME}"
REPO_ROOT = paths.REPO_ROOT
INVENTORY = str(paths.INVENTORY.relative_to(REPO_ROOT))


def session() -> requests.Session:
    s = requests.Session()
    s.trust_env = False  # test traffic goes to the testbed's addresses only
    return s


class Endpoint(traffic.Endpoint):
    def __init__(self, testbed):
        super().__init__(testbed, ROUTER, testbed.api_key_file)

    def counter(self, name: str, member: str) -> float:
        return self.counters(name).get(member, 0.0)

    def chat(self, max_tokens: int = 20, headers: dict | None = None, timeout: float = 60) -> str | None:
        """A streaming chat through the endpoint on a new connection, with any headers;
        None when it completed ([DONE] after content), else what went wrong."""
        body = {"model": "qwen", "messages": [{"role": "user", "content": "Tell me about Paris."}],
                "stream": True, "max_tokens": max_tokens}
        try:
            with session().post(f"{self.url}/v1/chat/completions", json=body, stream=True, timeout=timeout,
                                headers=self.auth if headers is None else headers) as r:
                if r.status_code != 200:
                    return f"HTTP {r.status_code}"
                lines = [line for line in r.iter_lines() if line]
        except requests.RequestException as exc:
            return type(exc).__name__
        return None if lines and lines[-1] == b"data: [DONE]" and len(lines) > 2 else f"cut after {len(lines)} lines"


def haproxy_pids(testbed) -> tuple[str, list[str]]:
    """(master pid, worker pids) of haproxy on the router host."""
    main = testbed.exec(ROUTER, "systemctl show haproxy -p MainPID --value").stdout.strip()
    workers = testbed.exec(ROUTER, f"pgrep -P {main} haproxy").stdout.split()
    return main, sorted(workers)


def engine_answers(testbed, name: str) -> bool:
    out = testbed.exec(name, "curl -s -m 2 -H @/etc/sparkfleet/api-auth.header http://127.0.0.1:8000/v1/models",
                       via="nsenter").stdout
    return '"qwen"' in out


def api(script: str) -> dict:
    """Run ``script`` with the endpoint's Python API against this fleet (a process of its
    own: pyinfra's CLI modules patch the interpreter with gevent); its last line is JSON."""
    code = (
        "import json\n"
        "from sparkfleet import endpoint, haproxy, status\n"
        f"state, settings = status.connect({INVENTORY!r}, {{'fleet_endpoint': {ROUTER_NAME!r}}})\n"
        "ep = endpoint.endpoint_host(state, settings)\n" + script
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def deploy(inventory: str = INVENTORY) -> subprocess.CompletedProcess:
    """`pyinfra -y INVENTORY deploy.py --data fleet_endpoint=<spark-1>` from the repo root."""
    return subprocess.run(["pyinfra", "-y", inventory, "deploy.py", "--data", DATA], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def ep(testbed):
    result = deploy()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    endpoint = Endpoint(testbed)
    endpoint.deploy_output = result.stdout + result.stderr
    for name in testbed.names:
        endpoint.wait_state(name, {"UP"}, timeout=30)
    return endpoint


def test_deploy_prints_the_endpoint_and_the_key_stays_private(testbed, ep):
    out = ep.deploy_output
    assert f"fleet endpoint {ep.url}/v1 serves `qwen` over 3 member(s)" in out, out[-3000:]
    assert f'curl -H "Authorization: Bearer $(cat {testbed.data["api_key_file"]})" {ep.url}/v1/models' in out
    assert f'openai.OpenAI(base_url="{ep.url}/v1"' in out
    assert ep.key not in out
    # Members at the addresses they have on the router's network, not inventory names.
    for h in testbed.hosts:
        assert f"{testbed.inventory_name(h.name)} {h.address}:8000" in out
    mode = testbed.exec(ROUTER, "stat -c '%a %U %G' /etc/haproxy/haproxy.cfg").stdout.split()
    assert mode == ["640", "root", "haproxy"]
    assert ep.key in testbed.exec(ROUTER, "cat /etc/haproxy/haproxy.cfg").stdout
    assert ep.chat() is None
    for where in ("ps -eo args", "journalctl -u haproxy --no-pager -o cat", "systemctl cat haproxy",
                  "ls -la /tmp /var/tmp"):
        assert ep.key not in testbed.exec(ROUTER, where).stdout, where


def test_clients_without_the_fleet_key_are_refused_at_the_endpoint(testbed, ep):
    before = {name: ep.counter("haproxy_server_http_responses_total", name) for name in testbed.names}
    s = session()
    for headers in ({}, {"Authorization": "Bearer wrong-key-0123456789"},
                    {"Authorization": f"Bearer {ep.key}x"}, {"Authorization": ep.key}):
        r = s.get(f"{ep.url}/v1/models", headers=headers, timeout=5)
        assert r.status_code == 401, (headers.keys(), r.status_code)
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert ep.chat(headers=headers) == "HTTP 401"
    # Refused by HAProxy itself: no member saw a request.
    assert {n: ep.counter("haproxy_server_http_responses_total", n) for n in testbed.names} == before
    assert s.get(f"{ep.url}/v1/models", headers=ep.auth, timeout=5).json()["data"][0]["id"] == "qwen"
    # The endpoint's own metrics need the key too.
    assert s.get(ep.metrics_url, timeout=5).status_code == 401
    assert "haproxy_frontend_http_requests_total" in s.get(ep.metrics_url, headers=ep.auth, timeout=5).text


def test_requests_are_spread_over_every_member(testbed, ep):
    before = {n: ep.counter("haproxy_server_sessions_total", n) for n in testbed.names}
    with traffic.Load(ep, workers=6) as load:
        time.sleep(8)
    assert load.failed == [] and load.ok >= 6
    spread = {n: ep.counter("haproxy_server_sessions_total", n) - before[n] for n in testbed.names}
    print(f"\n  leastconn over 3 members, 6 concurrent streams, 8 s: {load.ok} requests, per member {spread}")
    assert all(count >= 2 for count in spread.values()), spread


def test_a_dead_engine_leaves_the_rotation_within_10_s_and_comes_back(testbed, ep):
    member = testbed.names[1]
    with traffic.Load(ep, workers=3) as load:
        time.sleep(2)
        testbed.exec(member, "docker kill --signal KILL sparkfleet-serve")
        killed = time.monotonic()
        out_after = ep.wait_state(member, {"DOWN"}, timeout=10)
        failed_at_kill = len(load.failed)
        time.sleep(3)  # requests while it is out all go to the others
        failed_while_out = len(load.failed) - failed_at_kill
    # systemd restarts the engine (Restart=on-failure); it rejoins once it answers.
    deadline = time.monotonic() + 120
    while not engine_answers(testbed, member):
        assert time.monotonic() < deadline, f"{member}'s engine did not come back"
        time.sleep(0.5)
    back_after = ep.wait_state(member, {"UP"}, timeout=15)
    print(f"\n  killed engine: out of rotation {out_after:.1f} s after the kill; back {back_after:.1f} s after it "
          f"answered; requests {load.ok} ok, {failed_at_kill} failed in flight at the kill, "
          f"{failed_while_out} failed while out")
    assert out_after <= 10
    assert failed_while_out == 0, load.failed
    assert failed_at_kill <= 3, load.failed  # at most the streams that were on the killed engine
    assert time.monotonic() - killed < 130
    assert ep.chat() is None


def test_a_hung_engine_leaves_the_rotation_within_10_s(testbed, ep):
    member = testbed.names[2]
    testbed.exec(member, "docker pause sparkfleet-serve")
    try:
        out_after = ep.wait_state(member, {"DOWN"}, timeout=10)
    finally:
        testbed.exec(member, "docker unpause sparkfleet-serve")
    back_after = ep.wait_state(member, {"UP"}, timeout=10)
    print(f"\n  hung engine (docker pause): out of rotation after {out_after:.1f} s, back {back_after:.1f} s after unpause")
    assert out_after <= 10


def test_drain_waits_for_in_flight_requests_and_ready_puts_it_back(testbed, ep):
    member = testbed.names[2]
    name = testbed.inventory_name(member)
    # A long stream on every member, then drain one: it returns once its stream ended.
    with traffic.Load(ep, workers=3, max_tokens=150):
        time.sleep(1.5)
        result = api(
            "import time\n"
            "before = haproxy.members_of(ep)\n"
            "t = time.monotonic()\n"
            f"left = haproxy.drain(ep, {name!r}, timeout_s=120)\n"
            "took = time.monotonic() - t\n"
            "after = haproxy.members_of(ep)\n"
            f"print(json.dumps({{'left': left, 'took': took, 'in_flight_before': before[{name!r}].sessions, "
            f"'state': after[{name!r}].state, 'requests': after[{name!r}].requests}}))\n"
        )
        drained_requests = result["requests"]
        time.sleep(4)  # the load goes on: nothing new reaches the drained member
        assert ep.states()[member] == "DRAIN"
    print(f"\n  drain: {result['in_flight_before']} in flight, drained in {result['took']:.1f} s")
    assert result["left"] == 0 and result["state"] == "DRAIN"
    assert result["in_flight_before"] >= 1  # it waited for a stream that was running
    assert ep.counter("haproxy_server_sessions_total", member) == drained_requests
    # A reload (membership change) keeps it drained.
    # What the deploy's reload does: the admin states saved for the new worker first.
    testbed.exec(ROUTER, f"{save_state_command()}; systemctl reload haproxy")
    time.sleep(2)
    assert ep.states()[member] == "DRAIN"
    back = api(f"print(json.dumps({{'up': haproxy.ready(ep, {name!r}, timeout_s=10)}}))\n")
    assert back == {"up": True} and ep.states()[member] == "UP"


def test_status_shows_every_host_and_the_endpoint(testbed, ep):
    out = subprocess.run(["sparkfleet", "status", INVENTORY, "--data", DATA, "--json"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    digest = testbed.image["pinned"].split("@", 1)[1]
    for row in doc["hosts"]:
        assert row["reachable"] and row["unit"] == "active" and row["ready"], row
        assert row["profile"] == "dense" and row["image_digest"] == digest
        assert row["endpoint"] == "UP" and row["running"] == 0 and row["kv_cache"] is not None
        assert re.fullmatch(r"[0-9a-f]{40}", row["commit"] or "")
        assert row["uptime_s"] >= 0
    assert doc["endpoint"]["host"] == ROUTER_NAME and doc["endpoint"]["url"] == f"{ep.url}/v1"
    assert set(doc["endpoint"]["members"]) == {testbed.inventory_name(n) for n in testbed.names}
    assert doc["endpoint"]["state"] == "running" and doc["endpoint"]["requests"] >= 0  # counted since the last reload
    table = subprocess.run(["sparkfleet", "status", INVENTORY, "--data", DATA], cwd=REPO_ROOT,
                           capture_output=True, text=True, timeout=120).stdout
    assert re.search(r"^spark-2(?:\.local)?\s+dense\s+sha256:\w+\s+\w+\s+active\s+\S+\s+yes\s+UP", table, re.M), table
    assert f"fleet endpoint {ep.url}/v1 on {ROUTER_NAME}: running, 3/3 members in rotation" in table
    assert ep.key not in out.stdout + table


def test_status_and_a_converged_deploy_as_the_fleet_login(testbed, ep):
    # The session fleet logs in as DGX OS sets a Spark up: an ordinary user in group sudo
    # whose sudo asks for a password, not in group docker.
    assert testbed.state.login == "dgx"
    whoami = testbed.exec(ROUTER, "id -un; id -Gn", as_root=False).stdout.split("\n")
    assert whoami[0] == login.LOGIN_USER and "sudo" in whoami[1].split() and "docker" not in whoami[1].split()
    out = subprocess.run(["sparkfleet", "status", INVENTORY, "--data", DATA, "--json"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    result = deploy()
    assert out.returncode == 0, out.stderr[-2000:]
    doc = json.loads(out.stdout)
    assert all(r["ready"] and r["image_digest"] and r["endpoint"] == "UP" for r in doc["hosts"]), doc["hosts"]
    assert doc["endpoint"]["state"] == "running" and len(doc["endpoint"]["members"]) == 3
    combined = result.stdout + result.stderr
    assert result.returncode == 0 and changes(combined) == [], combined[-3000:]
    assert login.password() not in combined + out.stdout + out.stderr


def test_converged_rerun_changes_nothing_on_the_router_host(testbed, ep):
    pids = haproxy_pids(testbed)
    result = deploy()
    out = result.stdout + result.stderr
    assert result.returncode == 0 and changes(out) == [], out[-3000:]
    assert haproxy_pids(testbed) == pids  # not restarted, not reloaded
    assert f"fleet endpoint {ep.url}/v1 serves `qwen` over 3 member(s)" in out


def test_an_unreachable_member_keeps_its_place_and_the_others_serve(testbed, ep):
    gone = testbed.names[2]
    with testbed.unreachable(gone):
        result = deploy()
        out = result.stdout + result.stderr
        ep.wait_state(gone, {"DOWN"}, timeout=10)
        assert all(ep.chat() is None for _ in range(6))
    assert result.returncode != 0  # the unreachable host fails, the others go on
    assert not re.search(r"\[spark-1(?:\.local)?\] Success", out), out[-3000:]  # membership and config unchanged
    # Still a member, at the address it had (not dropped, not its inventory name).
    assert re.search(rf"over 3 member\(s\):.* {re.escape(testbed.inventory_name(gone))} {re.escape(testbed.host(gone).address)}:8000 ", out), out[-3000:]
    ep.wait_state(gone, {"UP"}, timeout=15)


def test_membership_changes_by_reload_and_drops_no_request(testbed, ep):
    gone = testbed.names[2]
    smaller = Path(paths.INVENTORY).with_name("inventory-without-spark-3.py")
    smaller.write_text(
        "from pathlib import Path\n"
        "from sparkfleet.testbed.state import inventory_hosts\n"
        f"sparks = ([h for h in inventory_hosts(Path({str(paths.HOSTS_JSON)!r})) "
        f"if h[0] != {testbed.inventory_name(gone)!r}], {{}})\n"
    )
    master, _ = haproxy_pids(testbed)
    try:
        with traffic.Load(ep, workers=6) as load:
            removed = deploy(str(smaller.relative_to(REPO_ROOT)))
            time.sleep(1)
            states_without = ep.states()
            added = deploy()
            ep.wait_state(gone, {"UP"}, timeout=15)
            time.sleep(1)
    finally:
        smaller.unlink()
    for result in (removed, added):
        out = result.stdout + result.stderr
        assert result.returncode == 0, out[-3000:]
        assert re.search(r"fleet endpoint: haproxy configuration\s+1\s+1", out), out[-3000:]
    assert gone not in states_without and len(states_without) == 2
    assert haproxy_pids(testbed)[0] == master  # reloaded, never restarted
    print(f"\n  membership -1 then +1 by reload under 6 concurrent streams: {load.ok} requests, "
          f"{len(load.failed)} failed {load.failed[:5]}")
    assert load.failed == [] and load.ok > 20


def test_reloads_under_load_drop_no_connection(testbed, ep):
    master, _ = haproxy_pids(testbed)
    with traffic.Load(ep, workers=8, max_tokens=10) as load:
        for _ in range(20):
            testbed.exec(ROUTER, "systemctl reload haproxy")
            time.sleep(0.5)
        time.sleep(1)
    print(f"\n  20 reloads in ~{20 * 0.6:.0f} s under 8 concurrent streams, each on a new connection: "
          f"{load.ok} requests, {len(load.failed)} failed {load.failed[:5]}")
    assert haproxy_pids(testbed)[0] == master
    assert load.failed == [] and load.ok > 50


def test_fleet_endpoint_none_stops_it_and_then_changes_nothing(testbed, ep):
    # The monitor follows the endpoint when left to auto: kept where it is, it changes nothing here.
    monitor = ("--data", f"fleet_monitor={testbed.inventory_name(ROUTER)}")
    result = subprocess.run(["pyinfra", "-y", INVENTORY, "deploy.py", "--data", "fleet_endpoint=none", *monitor],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    out = result.stdout + result.stderr
    assert result.returncode == 0 and changed_hosts(out) == {ROUTER}, out[-3000:]
    assert "former fleet endpoint: haproxy stopped" in out
    state = testbed.exec(ROUTER, "systemctl is-active haproxy; systemctl is-enabled haproxy").stdout.split()
    assert state[:2] == ["inactive", "disabled"], state
    with pytest.raises(requests.ConnectionError):
        session().get(f"{ep.url}/v1/models", headers=ep.auth, timeout=5)
    again = subprocess.run(["pyinfra", "-y", INVENTORY, "deploy.py", "--data", "fleet_endpoint=none", *monitor],
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    assert again.returncode == 0 and changes(again.stdout + again.stderr) == []
    table = subprocess.run(["sparkfleet", "status", INVENTORY], cwd=REPO_ROOT, capture_output=True, text=True,
                           timeout=120).stdout
    assert "fleet endpoint: none" in table, table
