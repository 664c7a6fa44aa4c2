"""Rolling changes without a fleet: which host rolls in which batch, a pair in its head's
turn, rollout=all, and turns that wait for the batch before them (@fake hosts in a real
pyinfra State; what a turn does on a host — the restart, READY, the gate — is patched)."""

from __future__ import annotations

import gc
import logging
import weakref

import gevent
import gevent.event
import pytest
from pyinfra.api.exceptions import OperationError
from pyinfra.context import ctx_host
from support.fleetdata import defaults, fake_state

from sparkfleet import remote, rollout
from sparkfleet.config import Settings, validate_host_data
from sparkfleet.fleet import validate_fleet
from sparkfleet.hostpaths import LAST_GOOD_DIR, REVISION_FILE, STARTED_FILE, UNIT
from sparkfleet.pairs import Pair, fleet_pairs
from sparkfleet.ready import restore_command
from sparkfleet.rollout import Rollout, applies

NAMES = [f"@fake/spark-{i}" for i in range(1, 6)]
S1, S2, S3, S4, S5 = NAMES
REV = "0123456789abcdef0123456789abcdef"


def settings(**data) -> Settings:
    return validate_host_data("spark-1", {**defaults(), **data})


def members(state) -> dict[str, Pair]:
    """Each pair member's pair, as the rollout gets it."""
    return fleet_pairs(state.inventory, validate_fleet(state.inventory))[0]


@pytest.fixture()
def five():
    """spark-1..5; spark-2 and spark-3 are pair_a (spark-2 its head); spark-1 the endpoint."""
    with fake_state(NAMES, pair_a=[S2, S3], endpoint=[S1]) as state:
        yield state


# --- who rolls when -----------------------------------------------------------------------------


def test_batches_follow_the_inventory_order_whatever_order_hosts_register_in(five):
    ro = Rollout(batch=2)
    for name in (S4, S1, S5, S3, S2, S1):  # the order greenlets happen to get there; spark-1 twice
        ro.register(name)
    assert ro.batches(five) == [[S1, S2], [S3, S4], [S5]]
    one_at_a_time = Rollout(batch=1)
    for name in reversed(NAMES):
        one_at_a_time.register(name)
    assert one_at_a_time.batches(five) == [[n] for n in NAMES]
    assert Rollout(batch=8).batches(five) == []  # nobody registered: nothing rolls


@pytest.mark.parametrize(("steps", "total", "sizes"), [
    ([1], 5, [1, 1, 1, 1, 1]), ([2], 5, [2, 2, 1]),
    ([1, "25%"], 16, [1, 4, 4, 4, 3]),  # a canary, then a quarter of the fleet at a time
    ([1, "25%"], 32, [1, 8, 8, 8, 7]), (["25%"], 3, [1, 1, 1]),  # a share of a few hosts: at least one
    (["100%"], 7, [7]), ([1, 2, "50%"], 10, [1, 2, 5, 2]),
])
def test_batches_take_counts_and_shares_of_the_fleet_the_last_repeating(steps, total, sizes):
    assert rollout.batch_sizes(steps, total) == sizes


def test_batches_of_a_canary_then_shares_follow_the_inventory(five):
    ro = Rollout(batch=[1, "50%"])
    for name in reversed(NAMES):
        ro.register(name)
    assert ro.batches(five) == [[S1], [S2, S3], [S4, S5]]
    assert rollout.batch_text([1, "50%"]) == "1, 50%" and rollout.batch_text([2]) == "2"


def test_a_pair_takes_one_turn_its_heads_and_its_headless_member_rolls_with_it(five):
    pair = members(five)
    ro = Rollout(batch=2)
    for name in (S5, S3, S4, S2, S1):  # the headless member registers before its head
        ro.register(name, pair.get(name))
    assert ro.batches(five) == [[S1, S2], [S4, S5]]  # spark-3 has no turn of its own
    assert set(ro.ended) == {S1, S2, S4, S5}
    assert {head: list(workers) for head, workers in ro.workers.items()} == {S2: [S3]}


def test_planning_waits_for_every_host_then_says_once_who_rolls_in_which_batch(five, monkeypatch, caplog):
    monkeypatch.setattr(remote, "check_sudo", lambda host, then=None: None)  # the fleet's sudo check asks the host
    caplog.set_level(logging.INFO, logger="pyinfra")
    s, pair = settings(rollout_batch=2), members(five)

    def plan(name: str) -> None:
        with ctx_host.use(five.inventory.get_host(name)):
            rollout.planned(s, pair.get(name))

    for name in reversed(NAMES):  # the last host of the inventory plans first
        five.pool.spawn(plan, name)
    five.pool.join(timeout=10, raise_error=True)

    said = sorted(r.getMessage() for r in caplog.records if "rolls in batch" in r.getMessage())
    steps = "(rollout_batch=2): drain, restart, gate, back in rotation"  # spark-1 serves the endpoint
    assert said == [f"[{S1}] rolls in batch 1 of 2 {steps}",
                    f"[{S2}] rolls in batch 1 of 2 with {S3} {steps}",
                    f"[{S4}] rolls in batch 2 of 2 {steps}",
                    f"[{S5}] rolls in batch 2 of 2 {steps}"]
    ro = rollout.rollout_of(five, s)
    assert ro.announced and ro.planning == 5 and ro.batches(five) == [[S1, S2], [S4, S5]]


def test_a_change_that_reboots_the_endpoints_host_rolls_it_last(five, monkeypatch, caplog):
    """Its reboot takes HAProxy down with it: every other host proves the change first (a bad
    kernel fails on spark-4, not on the host every client goes through)."""
    monkeypatch.setattr(remote, "check_sudo", lambda host, then=None: None)
    caplog.set_level(logging.INFO, logger="pyinfra")
    s = settings(rollout_batch=1)

    def plan(reboots: bool) -> list[list[str]]:
        change = rollout.Change(kind=f"stack {reboots}", what="upgrade", back="before", apply=lambda h: None,
                                undo=lambda h: None, reboots=reboots)

        def one(name: str) -> None:
            with ctx_host.use(five.inventory.get_host(name)):
                rollout.planned(s, None, change=change)

        for name in (S1, S4, S5):
            five.pool.spawn(one, name)
        five.pool.join(timeout=10, raise_error=True)
        return rollout.rollout_of(five, s, change.kind).batches(five)

    assert plan(reboots=False) == [[S1], [S4], [S5]]  # an engine restart: the endpoint stays up
    assert plan(reboots=True) == [[S4], [S5], [S1]]
    assert f"[{S1}] rolls in batch 3 of 3 (rollout_batch=1): drain, upgrade, gate, back in rotation" in caplog.text


def test_without_an_endpoint_the_plan_says_there_is_nothing_to_drain(monkeypatch, caplog):
    monkeypatch.setattr(remote, "check_sudo", lambda host, then=None: None)
    caplog.set_level(logging.INFO, logger="pyinfra")
    with fake_state([S1]) as state, ctx_host.use(state.inventory.get_host(S1)):
        rollout.planned(settings())
    assert [r.getMessage() for r in caplog.records if "rolls in" in r.getMessage()] == [
        f"[{S1}] rolls in batch 1 of 1 (rollout_batch=1): restart, gate (no fleet endpoint)"]


def test_executing_a_planned_host_registers_it_again_without_waiting_or_saying_it(five, caplog):
    caplog.set_level(logging.INFO, logger="pyinfra")
    five.is_executing = True
    five.pool.spawn(gevent.sleep, 30)  # a host still planning would hold the announcement back
    try:
        with ctx_host.use(five.inventory.get_host(S4)), gevent.Timeout(2):
            rollout.planned(settings())
    finally:
        five.pool.kill()
    ro = rollout.rollout_of(five, settings())
    assert ro.names == [S4] and ro.planning == 0 and not ro.announced
    assert not [r for r in caplog.records if "rolls in" in r.getMessage()]


def test_a_host_rolls_only_when_rollout_is_rolling_and_it_serves_now():
    rolling, at_once = settings(), settings(rollout="all")
    active = {"ActiveState": "active", "SubState": "running"}
    assert applies(rolling, active, "rev1", "rev1")
    assert not applies(at_once, active, "rev1", "rev1")  # rollout=all: every host restarts at once, no turns
    assert not applies(rolling, {"ActiveState": "failed"}, "rev1", "rev1")  # serves nothing: nothing to keep serving
    assert not applies(rolling, {"ActiveState": "activating"}, "rev1", "rev1")  # a crash loop restarts now
    assert not applies(rolling, {}, None, None)  # a fresh host
    assert not applies(rolling, active, "rev2", "rev1")  # runs settings that never got READY: nothing to keep


def test_a_new_key_port_or_name_still_rolls():
    """The judgement reads the host's record, not its API with the new settings: a key,
    port or served-name change would make a serving engine look dead (401, nothing on the
    port, another model) and restart it at once, with no drain and no gate."""
    active = {"ActiveState": "active", "SubState": "running"}
    for changed in ({"port": 9001}, {"served_model_name": "renamed"}, {"api_key": "ROTATEDkey0123456789abcdef0123"}):
        assert applies(settings(**changed), active, "rev1", "rev1"), changed


def test_a_rollout_belongs_to_its_run():
    """One Rollout per State, none kept after it: a later run (whose State may get the id
    of an ended one) never inherits an ended run's turns or its stop."""
    s = settings()
    with fake_state([S1]) as first:
        ro = rollout.rollout_of(first, s)
        assert rollout.rollout_of(first, s) is ro
        ro.register(S1)
        ro.stopped = f"{S1} (gate)"
        kept = weakref.ref(ro)
    with fake_state([S1]) as second:
        fresh = rollout.rollout_of(second, s)
        assert fresh is not ro and fresh.stopped is None and fresh.names == []
    del first, second, ro
    gc.collect()
    assert kept() is None


# --- turns --------------------------------------------------------------------------------------


def test_a_later_batch_waits_for_every_host_of_the_batches_before_it(five):
    ro = Rollout(batch=2)
    for name in NAMES:
        ro.register(name)
    with gevent.Timeout(1):
        ro.wait_turn(five, S2)  # batch 1 goes at once
    waiting = gevent.spawn(ro.wait_turn, five, S5)
    gevent.sleep(0.05)
    assert not waiting.dead
    for name in (S1, S2, S3):
        ro.ended[name].set()
        gevent.sleep(0.05)
        assert not waiting.dead, f"batch 3 went with {S4} still rolling"
    ro.ended[S4].set()
    waiting.join(timeout=1)
    assert waiting.successful()


class _Polled(gevent.event.Event):
    """An event whose waits wake every few milliseconds, not every 2 s."""

    def wait(self, timeout=None):
        return super().wait(timeout=0.01 if timeout is not None else None)


def test_a_host_that_failed_before_its_turn_does_not_hold_the_next_batch(five):
    ro = Rollout(batch=1)
    for name in (S1, S2):
        ro.register(name)
    ro.ended[S1] = _Polled()
    waiting = gevent.spawn(ro.wait_turn, five, S2)
    gevent.sleep(0.05)
    assert not waiting.dead
    five.failed_hosts.add(five.inventory.get_host(S1))  # e.g. its image did not pull
    waiting.join(timeout=1)
    assert waiting.successful()


PAIR_WAIT = (" (a pair's wait)",)


class Hosts:
    """The host side of turns: every command run on a host and every READY wait, in order."""

    def __init__(self, monkeypatch, ready_error: dict[str, str] | None = None, running: str = "old-rev"):
        self.log: list[tuple[str, str]] = []
        self.ready_error, self.running = ready_error or {}, running
        monkeypatch.setattr(rollout, "_endpoint", lambda state, host: None)
        monkeypatch.setattr(rollout.remote, "run", self.run)
        # READY's arguments: a mark for a pair's wait (a pair starts slower than one Spark).
        monkeypatch.setattr(rollout.ready, "ready_for", lambda settings, host, pair=False: PAIR_WAIT if pair else ())
        monkeypatch.setattr(rollout.ready, "wait_ready", self.wait_ready)
        monkeypatch.setattr(rollout, "gate", lambda host, settings, acceptance_floor=True: None)

    def run(self, host, command, timeout=None, **kwargs):
        self.log.append((host.name, str(command)))
        gevent.sleep(0.001)  # a round trip: other hosts' greenlets run meanwhile
        if command in (f"cat {STARTED_FILE}", f"cat {LAST_GOOD_DIR}/serving.rev"):
            return remote.Result(True, [self.running] if self.running else [], [])
        return remote.Result(True, [], [])

    def wait_ready(self, state, host, *args, restarting, peers=()):
        assert restarting and args in ((), PAIR_WAIT)
        gevent.sleep(0.01)
        self.log.append((host.name, "READY" + "".join(f" with {p.name}" for p in peers) + " ".join(args)))
        if host.name in self.ready_error:
            raise OperationError(self.ready_error[host.name])
        return True

    def restarts(self) -> list[str]:
        return [name for name, command in self.log if "systemctl restart" in command]


def step(command: str) -> str:
    """A logged command in a word: restart, rejoin (a pair member restarted by its head), revision."""
    if command.startswith("READY"):
        return command
    if f"systemctl restart --no-block {UNIT}" in command:
        return "rejoin"
    if f"systemctl restart {UNIT}" in command:
        return "restart"
    return "revision" if command.startswith("echo ") else command


def roll(state, s: Settings, names: list[str], pair: dict | None = None) -> dict[str, object]:
    """Every host's turn, each in its own greenlet (started last host first), as pyinfra
    executes the operation: True, or the OperationError it failed with."""
    pair = pair or {}
    ro = rollout.rollout_of(state, s)
    for name in names:  # what planning registered
        ro.register(name, pair.get(name))

    def turn(name):
        host = state.inventory.get_host(name)
        try:
            return rollout.rolled(state, host, s, REV, pair.get(name))
        except OperationError as exc:
            return exc

    greenlets = {name: gevent.spawn(turn, name) for name in reversed(names)}
    gevent.joinall(list(greenlets.values()), timeout=10, raise_error=True)
    return {name: g.value for name, g in greenlets.items()}


def test_hosts_restart_one_batch_after_another_each_after_the_one_before_is_ready(five, monkeypatch):
    hosts = Hosts(monkeypatch)
    got = roll(five, settings(rollout_batch=1), [S1, S4, S5])
    assert got == {S1: True, S4: True, S5: True}
    restart = f"echo {REV} > {REVISION_FILE} && systemctl reset-failed {UNIT} 2>/dev/null; systemctl restart {UNIT}"
    assert hosts.log == [(S1, restart), (S1, "READY"), (S4, restart), (S4, "READY"), (S5, restart), (S5, "READY")]


def test_hosts_of_one_batch_restart_together(five, monkeypatch):
    hosts = Hosts(monkeypatch)
    roll(five, settings(rollout_batch=2), [S1, S4, S5])
    order = [(name, "READY" if what == "READY" else "restart") for name, what in hosts.log]
    assert set(order[:2]) == {(S1, "restart"), (S4, "restart")}  # batch 1: both out at once
    assert set(order[2:4]) == {(S1, "READY"), (S4, "READY")}
    assert order[4:] == [(S5, "restart"), (S5, "READY")]


def test_a_pair_restarts_in_its_heads_turn_its_headless_member_first(five, monkeypatch):
    hosts = Hosts(monkeypatch)
    got = roll(five, settings(rollout_batch=1), [S1, S2, S3], members(five))
    assert got == {S1: True, S2: True, S3: True}
    steps = [(name, step(command)) for name, command in hosts.log]
    assert [s for s in steps if s[1] != "revision"] == [
        (S1, "restart"), (S1, "READY"),
        (S3, "rejoin"),  # restarted by its head, to rejoin the head's new engine...
        (S2, "restart"), (S2, f"READY with {S3} (a pair's wait)"),  # ...which waits for READY and gates for both
    ]
    assert steps.index((S3, "revision")) < steps.index((S3, "rejoin"))  # the member's revision, by itself
    assert (S3, f"echo {REV} > {REVISION_FILE}") in hosts.log


def test_a_rollout_that_stops_leaves_the_later_hosts_serving_what_they_ran(five, monkeypatch):
    hosts = Hosts(monkeypatch, ready_error={S1: "the new settings did not get READY (the engine exited); "
                                                "rolled back: the last good settings serve again"})
    got = roll(five, settings(rollout_batch=1), [S1, S4, S5])
    assert str(got[S1]).startswith(f"rollout stopped at {S1}, step READY: the new settings did not get READY")
    for name in (S4, S5):
        assert str(got[name]) == (f"rollout: not changed — the rollout stopped at {S1} (READY); this host serves "
                                  "what it ran (files put back to them, no restart). Fix the data and deploy "
                                  "again: the rollout resumes here.")
        assert (name, restore_command(restart=False)) in hosts.log
    assert hosts.restarts() == [S1]  # nobody else was touched


def test_a_stop_the_turn_worded_is_not_worded_again_when_the_host_is_gone(five, monkeypatch):
    Hosts(monkeypatch, ready_error={S1: "not READY after 900 s"})
    monkeypatch.setattr(rollout.remote, "answers", lambda host: False)  # it went away after the stop
    got = roll(five, settings(rollout_batch=1), [S1])
    assert isinstance(got[S1], rollout.Stopped)
    assert str(got[S1]) == f"rollout stopped at {S1}, step READY: not READY after 900 s"


def test_a_host_lost_in_its_turn_stops_the_rollout_at_that_step(five, monkeypatch):
    Hosts(monkeypatch)
    monkeypatch.setattr(rollout.remote, "answers", lambda host: False)

    def gate_lost(host, settings, acceptance_floor=True):
        raise OSError("Socket closed")

    monkeypatch.setattr(rollout, "gate", gate_lost)
    got = roll(five, settings(rollout_batch=1), [S1])
    assert isinstance(got[S1], rollout.Stopped)
    assert str(got[S1]) == f"rollout stopped at {S1}, step gate: {remote.LOST}"


def test_a_headless_member_whose_head_did_not_roll_does_not_change(five, monkeypatch):
    hosts = Hosts(monkeypatch, ready_error={S1: "not READY after 900 s"}, running="")
    got = roll(five, settings(rollout_batch=1), [S1, S2, S3], members(five))
    assert isinstance(got[S1], OperationError)
    assert str(got[S2]).startswith(f"rollout: not changed — the rollout stopped at {S1} (READY)")
    assert str(got[S3]).startswith(f"rollout: not changed — {S2}, the head of pair_a, did not roll "
                                   f"({S1} (READY)); this host serves what it ran (its files are the new ones")
    assert hosts.restarts() == [S1]


@pytest.mark.parametrize("data,url", [
    ({"ssh_hostname": "10.0.0.11"}, "http://10.0.0.11:8000"),
    ({"ssh_hostname": "fd00::11"}, "http://[fd00::11]:8000"),
    ({"ssh_hostname": "spark-1.lan"}, "http://spark-1.lan:8000"),
    ({"bind_address": "192.168.7.2", "port": 8100}, "http://192.168.7.2:8100"),
    ({"bind_address": "fd00::7"}, "http://[fd00::7]:8000"),
], ids=["ssh-ipv4", "ssh-ipv6", "ssh-name", "bound-ipv4", "bound-ipv6"])
def test_the_gate_asks_the_api_where_the_controller_reaches_it(data, url):
    with fake_state([S1], data) as state:
        assert rollout.api_url(state.inventory.get_host(S1), settings(**data)) == url


def test_a_gate_cannot_reach_an_api_bound_to_loopback():
    with fake_state([S1]) as state, pytest.raises(OperationError, match="--data rollout=all"):
        rollout.api_url(state.inventory.get_host(S1), settings(bind_address="127.0.0.1"))


def test_a_missed_query_of_the_endpoint_is_asked_again_before_rolling_without_draining(monkeypatch):
    from types import SimpleNamespace

    calls = []

    def members_of(ep):  # the first query is missed (a loaded host), the next answers
        calls.append(ep.name)
        if len(calls) == 1:
            raise OperationError("spark-1: the HAProxy runtime API did not answer `show stat`")
        return {rollout.haproxy.server_name("spark-2"): None}

    ep = SimpleNamespace(name="spark-1", connected=True)
    said = []
    spark2 = SimpleNamespace(name="spark-2", log=lambda text, how: said.append(text))
    monkeypatch.setattr(rollout.haproxy, "members_of", members_of)
    monkeypatch.setattr(rollout.endpoint, "endpoint_host", lambda state: ep)
    monkeypatch.setattr(rollout, "ENDPOINT_RETRY_S", 0)
    assert rollout._endpoint(None, spark2) is ep and calls == ["spark-1", "spark-1"] and said == []
    # A host the run cannot reach is not asked again: the turn rolls without draining at once.
    calls.clear()
    ep.connected = False
    assert rollout._endpoint(None, spark2) is None and calls == ["spark-1"]
    assert "rolling without draining" in said[-1]
    # A host the endpoint does not list (not served yet) has no client to drain: it says so.
    ep.connected = True
    spark3 = SimpleNamespace(name="spark-3", log=lambda text, how: said.append(text))
    assert rollout._endpoint(None, spark3) is None
    assert said[-1] == "not in the fleet endpoint's rotation: rolls without draining"


class _GateClient:
    """The host's API as the gate sees it: Paris, a tool call, a decode request of ``rate``."""

    base_url = "http://spark-1:8000"

    def __init__(self, rate: float, drafts: tuple[int, int] = (0, 0)):
        self.rate, self.drafts, self.asked = rate, drafts, 0

    def metrics_text(self) -> str:
        self.asked += 1
        drafts, accepted = self.drafts if self.asked > 1 else (0, 0)
        return (f"vllm:spec_decode_num_drafts_total {drafts}\nvllm:spec_decode_num_accepted_tokens_total {accepted}\n"
                "vllm:spec_decode_num_draft_tokens_total 0\n")

    def complete(self, prompt: str, max_tokens: int):
        if max_tokens == rollout.GATE_DECODE_TOKENS:
            return {"choices": [{"text": "..."}], "usage": {"completion_tokens": 128}}, 128 / self.rate
        return {"choices": [{"text": "Paris."}], "usage": {"completion_tokens": 2}}, 0.1


@pytest.mark.parametrize("profile,rate,drafts,problem", [
    ("base", 28.0, (0, 0), None),
    ("base", 9.0, (0, 0), "decode rate 9.0 tok/s (128 tokens in 14.2 s) is below rollout_min_decode_tok_s 14"),
    ("dense", 48.0, (40, 52), None),
    ("dense", 48.0, (100, 10), "acceptance length 1.10 is below rollout_min_acceptance 1.5"),
], ids=["base-ok", "base-slow", "dense-ok", "dense-low-acceptance"])
def test_the_gate_holds_a_decode_rate_floor_and_an_acceptance_floor(monkeypatch, profile, rate, drafts, problem):
    from types import SimpleNamespace

    client = _GateClient(rate, drafts)
    said = []
    monkeypatch.setattr(rollout, "Client", lambda *a, **k: client)
    monkeypatch.setattr(rollout, "api_url", lambda host, s: client.base_url)
    monkeypatch.setattr(rollout, "tool_call_round_trip", lambda c: {"passed": True})
    host = SimpleNamespace(name=S1, log=lambda text, how: said.append(text))
    got = rollout.gate(host, settings(profile=profile))
    if problem is None:
        assert got is None and f"decode {rate:.1f} tok/s" in said[-1], (got, said)
    else:
        assert got and got.startswith(problem), got
    # A rollback's gate asks no decode request: the settings it restores were served before.
    assert rollout.gate(host, settings(profile=profile), acceptance_floor=False) is None


def roll_change(state, s: Settings, names: list[str], failing: str | None = None,
                stuck: bool = False, slow_link: str | None = None) -> tuple[dict, list]:
    """A stack change's turns (pair_a's members change in its head's turn): what each turn
    returned, and every apply, undo and link measurement in order (``failing``: that host's
    apply fails; ``stuck``: its undo too; ``slow_link``: that member's link measures below
    its floor)."""
    pairs, made = members(state), []

    def measured(target):
        made.append(("proven", target.name))
        return "all_gather 4 GB/s, below the floor of 21.875 GB/s" if target.name == slow_link else None

    def change(name):
        def apply(target):
            made.append(("apply", target.name))
            gevent.sleep(0.01)  # a reboot: the other member's change runs meanwhile
            made.append(("applied", target.name))
            return "apt-get install failed" if target.name == failing else None

        return rollout.Change(kind="stack", what="upgrade the stack", back="the previous versions", apply=apply,
                              undo=lambda target: made.append(("undo", target.name)) or (
                                  "the old version is gone" if stuck and target.name == failing else None),
                              proven=measured if name in pairs else None)

    ro = rollout.rollout_of(state, s, "stack")
    for name in names:
        ro.register(name, pairs.get(name))

    def turn(name):
        try:
            return rollout.rolled(state, state.inventory.get_host(name), s, None, pairs.get(name), change(name))
        except OperationError as exc:
            return exc

    greenlets = {name: gevent.spawn(turn, name) for name in reversed(names)}
    gevent.joinall(list(greenlets.values()), timeout=10, raise_error=True)
    return {name: g.value for name, g in greenlets.items()}, made


def test_a_pairs_stack_change_is_made_on_both_members_at_once_in_its_heads_turn(five, monkeypatch):
    hosts = Hosts(monkeypatch)
    monkeypatch.setattr(rollout.ready, "await_ready", lambda host, *a: hosts.log.append((host.name, "READY" + "".join(a))))
    got, made = roll_change(five, settings(rollout_batch=1), [S1, S2, S3])
    assert got == {S1: True, S2: True, S3: True}
    assert made[:2] == [("apply", S1), ("applied", S1)]  # S1 alone, then the pair as one
    assert set(made[2:4]) == {("apply", S2), ("apply", S3)} and set(made[4:6]) == {("applied", S2), ("applied", S3)}
    assert hosts.log == [(S1, "READY"), (S2, "READY (a pair's wait)")]  # the pair is READY and gated at its head
    assert set(made[6:]) == {("proven", S2), ("proven", S3)}  # then its link, measured at both ends


def test_a_pairs_link_below_its_floor_after_the_change_fails_the_gate_and_both_go_back(five, monkeypatch):
    hosts = Hosts(monkeypatch)
    monkeypatch.setattr(rollout.ready, "await_ready", lambda host, *a: hosts.log.append((host.name, "READY")))
    monkeypatch.setattr(rollout.ready, "journal_tail", lambda host: "")
    got, made = roll_change(five, settings(rollout_batch=1), [S2, S3], slow_link=S3)
    assert str(got[S2]).startswith(f"rollout stopped at {S2}, step gate (the pair's link): {S3}: all_gather 4 GB/s, "
                                   "below the floor"), got[S2]
    assert made.index(("proven", S3)) < made.index(("undo", S2)) and ("undo", S3) in made, made


def test_a_pairs_stack_change_that_fails_on_its_member_goes_back_on_both_and_stops(five, monkeypatch):
    hosts = Hosts(monkeypatch)
    monkeypatch.setattr(rollout.ready, "await_ready", lambda host, *a: hosts.log.append((host.name, "READY")))
    monkeypatch.setattr(rollout.ready, "journal_tail", lambda host: "")
    got, made = roll_change(five, settings(rollout_batch=1), [S2, S3, S4], failing=S3)
    assert str(got[S2]).startswith(f"rollout stopped at {S2}, step upgrade the stack: {S3}: apt-get install failed; "
                                   "went back: the previous versions"), got[S2]
    assert str(got[S3]).startswith(f"rollout: rolled with its head {S2}, which stopped at {S2}"), got[S3]
    assert str(got[S4]).startswith(f"rollout: not changed — the rollout stopped at {S2}"), got[S4]
    assert {("undo", S2), ("undo", S3)} <= set(made) and ("apply", S4) not in made


def test_a_pair_that_cannot_go_back_is_left_drained_with_both_engines_stopped(five, monkeypatch):
    hosts = Hosts(monkeypatch)
    monkeypatch.setattr(rollout.ready, "await_ready", lambda host, *a: hosts.log.append((host.name, "READY")))
    monkeypatch.setattr(rollout.ready, "journal_tail", lambda host: "")
    got, _ = roll_change(five, settings(rollout_batch=1), [S2, S3], failing=S3, stuck=True)
    assert f"could not go back ({S3}: the old version is gone): left drained" in str(got[S2]), got[S2]
    assert {(S2, f"systemctl stop {UNIT}"), (S3, f"systemctl stop {UNIT}")} <= set(hosts.log), hosts.log
