"""The operator lock without a fleet: the program a host runs (on files of this machine), the
all-or-nothing take across hosts, the take-over of a dead run's lock, the give-back
callbacks and `sparkfleet unlock`'s decisions."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace

import pytest
from pyinfra.api.exceptions import OperationError

from sparkfleet import oplock, remote, unlock
from sparkfleet.hostpaths import OPERATOR_LOCK


def program(path, action: str, arg: dict) -> dict:
    """The lock program as a host runs it, on ``path``."""
    done = subprocess.run(oplock.argv(str(path), action, arg), capture_output=True, text=True, timeout=30, check=True)
    return oplock.answer(done.stdout.splitlines())


def holder(run: str, **kw) -> oplock.Holder:
    return oplock.Holder(run=run, user="ana", controller="laptop-2", machine="elsewhere", pid=4242,
                         what="deploy.py", **kw)


def dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


# --- the program on the host ----------------------------------------------------------------


def test_a_free_lock_is_taken_with_the_hosts_time_and_the_run_passes_again(tmp_path):
    lock = tmp_path / "lock"
    mine = asdict(holder("run-a"))
    first = program(lock, "take", {"holder": mine, "stale": ""})
    assert first["done"] and first["held"] is None
    record = json.loads(lock.read_text())
    assert record["run"] == "run-a" and abs(record["since"] - first["now"]) < 5
    again = program(lock, "take", {"holder": mine, "stale": ""})
    assert again["done"] and again["held"]["since"] == record["since"]  # the run itself: kept as it was


@pytest.fixture()
def public_dir():
    """A directory any user reaches (pytest's own are root's only)."""
    import shutil
    import tempfile

    made = Path(tempfile.mkdtemp(prefix="sparkfleet-oplock-"))
    made.chmod(0o755)
    yield made
    shutil.rmtree(made)


@pytest.mark.skipif(os.geteuid() != 0, reason="root makes the lock group sudo's, and runs it as another user")
def test_root_makes_the_lock_group_sudos_and_an_admin_login_takes_it_without_sudo(public_dir):
    import grp

    admins = grp.getgrnam("sudo").gr_gid  # DGX OS's admins; Ubuntu has the group
    lock = public_dir / "lock"
    lock.write_text("")
    lock.chmod(0o644)  # as an earlier version left it
    program(lock, "show", {})
    assert (lock.stat().st_gid, lock.stat().st_mode & 0o7777) == (admins, 0o660)

    def as_login(path: Path, action: str, arg: dict, *groups: int) -> subprocess.CompletedProcess:
        return subprocess.run(oplock.argv(str(path), action, arg),
                              capture_output=True, text=True, timeout=30, user=65534, group=65534,
                              extra_groups=list(groups))

    take = {"holder": asdict(holder("run-a")), "stale": ""}
    refused = as_login(lock, "take", take)  # a login outside the group: the deploy asks again through sudo
    assert refused.returncode == oplock._NOT_MINE and refused.stdout == "" and lock.read_text() == ""
    taken = as_login(lock, "take", take, admins)
    assert taken.returncode == 0 and oplock.answer(taken.stdout.splitlines())["done"]
    assert json.loads(lock.read_text())["run"] == "run-a"
    assert as_login(public_dir / "missing", "show", {}, admins).returncode == oplock._NOT_MINE  # root makes it


@pytest.mark.parametrize("login_may_write", [True, False])
def test_ask_runs_the_program_as_the_login_and_through_sudo_only_where_it_may_not_write(
        monkeypatch, tmp_path, login_may_write):
    """A take costs no sudo where the login may write the lock; where the program says it may
    not (exit 77, nothing printed), the same command once more through sudo."""
    lock = tmp_path / "lock"
    monkeypatch.setattr(oplock, "OPERATOR_LOCK", str(lock))
    ran = []

    def run(target, command, timeout=60, as_login=False, success_exit_codes=None, **_):
        ran.append((str(command), as_login, success_exit_codes))
        if as_login and not login_may_write:  # the program's exit 77: a success the caller asked for
            return remote.Result(77 in success_exit_codes, [], [])
        done = subprocess.run(["sh", "-c", str(command)], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"})
        return remote.Result(done.returncode == 0, done.stdout.splitlines(), done.stderr.splitlines())

    monkeypatch.setattr(remote, "run", run)
    answer = oplock.ask(SimpleNamespace(name="spark-1"), "take", {"holder": asdict(holder("run-a")), "stale": ""})
    assert answer["done"] and json.loads(lock.read_text())["run"] == "run-a"
    assert [as_login for _, as_login, _ in ran] == ([True] if login_may_write else [True, False])
    assert ran[0][2] == [0, oplock._NOT_MINE] and len({command for command, _, _ in ran}) == 1
    lock.write_text("{not json")
    monkeypatch.setattr(oplock, "_PROGRAM", "echo 'the lock program broke' >&2; exit 1")
    with pytest.raises(OperationError, match="the lock program failed: the lock program broke"):
        oplock.ask(SimpleNamespace(name="spark-1"), "show", {})


def test_another_run_is_refused_and_told_who_holds_it(tmp_path):
    lock = tmp_path / "lock"
    program(lock, "take", {"holder": asdict(holder("run-a")), "stale": ""})
    other = program(lock, "take", {"holder": asdict(holder("run-b")), "stale": ""})
    assert not other["done"] and other["held"]["run"] == "run-a" and other["held"]["user"] == "ana"
    assert json.loads(lock.read_text())["run"] == "run-a"


def test_only_the_holder_gives_it_back_and_empty_is_free(tmp_path):
    lock = tmp_path / "lock"
    program(lock, "take", {"holder": asdict(holder("run-a")), "stale": ""})
    assert not program(lock, "give", {"run": "run-b"})["done"]
    assert json.loads(lock.read_text())["run"] == "run-a"
    assert program(lock, "give", {"run": "run-a"})["done"]
    assert lock.exists() and lock.read_text() == ""  # emptied, never removed
    assert program(lock, "show", {})["held"] is None
    assert program(lock, "take", {"holder": asdict(holder("run-b")), "stale": ""})["done"]


def test_a_stale_run_is_replaced_only_when_it_is_the_one_named(tmp_path):
    lock = tmp_path / "lock"
    program(lock, "take", {"holder": asdict(holder("run-a")), "stale": ""})
    assert not program(lock, "take", {"holder": asdict(holder("run-b")), "stale": "run-x"})["done"]
    taken = program(lock, "take", {"holder": asdict(holder("run-b")), "stale": "run-a"})
    assert taken["done"] and taken["held"]["run"] == "run-a"
    assert json.loads(lock.read_text())["run"] == "run-b"


def test_runs_racing_for_one_host_see_one_winner(tmp_path):
    lock = tmp_path / "lock"
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: program(lock, "take", {"holder": asdict(holder(f"run-{i}")), "stale": ""}),
                                range(8)))
    winners = [a for a in answers if a["done"]]
    assert len(winners) == 1
    assert all(a["held"]["run"] == json.loads(lock.read_text())["run"] for a in answers if not a["done"])


# --- who holds it -----------------------------------------------------------------------------


def test_a_holder_is_described_by_who_since_when_and_how_long():
    found = holder("1a2b3c", since=1_764_675_005.0)
    text = found.describe(now=1_764_675_005.0 + 252)
    assert text == ("ana@laptop-2 (pyinfra pid 4242, run 1a2b3c: deploy.py) since 2025-12-02 11:30:05 UTC "
                    "(4m12s ago)")
    assert oplock.Holder.of(None) is None and oplock.Holder.of({}) is None
    assert oplock.Holder.of({"run": "?", "unreadable": "junk"}).run == "?"
    assert oplock.Holder.of({"run": "r", "pid": "not a pid"}).run == "r"


def test_only_a_run_of_this_controller_whose_pid_is_gone_is_provably_dead():
    here = oplock.machine_id()
    assert oplock.still_runs(oplock.Holder(run="r", machine=here, pid=dead_pid())) is False
    assert oplock.still_runs(oplock.Holder(run="r", machine=here, pid=os.getpid())) is True
    assert oplock.still_runs(oplock.Holder(run="r", machine="another laptop", pid=dead_pid())) is None
    killed = subprocess.Popen(["sleep", "60"])
    killed.kill()  # killed, not yet reaped: a zombie
    try:
        deadline = time.monotonic() + 10
        while oplock.still_runs(oplock.Holder(run="r", machine=here, pid=killed.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)  # the kill lands
        assert oplock.still_runs(oplock.Holder(run="r", machine=here, pid=killed.pid)) is False
    finally:
        killed.wait()


# --- the run, over several hosts --------------------------------------------------------------


class LockHost:
    """A pyinfra host on this machine whose operator lock is a file of its own."""

    def __init__(self, name: str, directory) -> None:
        self.name = name
        self.print_prefix = f"[{name}] "
        self.lock = directory / f"{name}.lock"
        self.op_hash_order = ["op-lock", "op-preflight", f"op-last-{name}"]
        self.commands = 0

    def run_shell_command(self, command, print_output=False, **_):
        self.commands += 1
        text = command.get_raw_value().replace(OPERATOR_LOCK, str(self.lock))
        proc = subprocess.run(["sh", "-c", text], capture_output=True, text=True, timeout=30)
        return proc.returncode == 0, SimpleNamespace(stdout_lines=proc.stdout.splitlines(),
                                                     stderr_lines=proc.stderr.splitlines())

    def holder(self) -> str | None:
        text = self.lock.read_text() if self.lock.exists() else ""
        return json.loads(text)["run"] if text.strip() else None


class Inventory(list):
    def get_host(self, name):
        return next(h for h in self if h.name == name)


class FakeState:
    """What the lock reads of pyinfra's State (weak-referenceable, as perrun.once needs):
    each host's operations yield the commands of :attr:`planned` (none by default)."""

    def __init__(self, hosts) -> None:
        self.inventory = Inventory(hosts)
        self.active_hosts = set(hosts)
        self.ignored: set[tuple[str, str]] = set()
        self.planned: dict[tuple[str, str], list[str]] = {}
        self.handlers: list = []
        self.ops = {h: {op: self._data(h.name, op) for op in h.op_hash_order} for h in hosts}

    def _data(self, name, op_hash):
        def commands():  # a generator, as pyinfra's
            yield from self.planned.get((name, op_hash), [])

        return SimpleNamespace(command_generator=commands,
                               global_arguments={"_ignore_errors": (name, op_hash) in self.ignored})

    def get_op_data_for_host(self, host, op_hash):
        data = self.ops[host][op_hash]
        data.global_arguments["_ignore_errors"] = (host.name, op_hash) in self.ignored
        return data

    def add_callback_handler(self, handler) -> None:
        self.handlers.append(handler)

    def commands(self, host, op_hash) -> list:
        return list(self.ops[host][op_hash].command_generator())


@pytest.fixture()
def fleet(tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "connector_arguments", lambda host: {})
    hosts = [LockHost(f"spark-{i}", tmp_path) for i in (1, 2, 3)]
    return FakeState(hosts), hosts


def test_every_host_is_taken_and_each_gives_it_back_after_its_last_operation(fleet):
    state, hosts = fleet
    run = oplock._run(state)
    oplock._track(state, run)
    oplock._take_all(state, run)
    assert not run.failure and run.taken == {"spark-1", "spark-2", "spark-3"}
    assert {h.holder() for h in hosts} == {run.mine.run}
    callbacks = oplock._GiveBack()
    callbacks.operation_host_success(state, hosts[0], "op-preflight")
    assert hosts[0].holder() == run.mine.run  # not its last operation
    callbacks.operation_host_success(state, hosts[0], "op-last-spark-1")
    assert hosts[0].holder() is None and hosts[1].holder() == run.mine.run


def test_a_failed_host_gives_it_back_at_once_unless_the_error_is_ignored(fleet):
    state, hosts = fleet
    run = oplock._run(state)
    oplock._track(state, run)
    oplock._take_all(state, run)
    state.ignored.add(("spark-2", "op-preflight"))
    oplock._GiveBack.operation_host_error(state, hosts[1], "op-preflight")
    assert hosts[1].holder() == run.mine.run  # _ignore_errors: the host goes on
    oplock._GiveBack.operation_host_error(state, hosts[2], "op-preflight")
    assert hosts[2].holder() is None and hosts[0].holder() == run.mine.run
    commands = hosts[2].commands
    oplock._GiveBack.operation_host_error(state, hosts[2], "op-last-spark-3")
    assert hosts[2].commands == commands  # given back once


def test_one_host_held_by_another_run_stops_every_host_and_gives_back_the_others(fleet):
    state, hosts = fleet
    program(hosts[2].lock, "take", {"holder": asdict(holder("their-run")), "stale": ""})
    run = oplock._run(state)
    oplock._take_all(state, run)
    assert run.taken == set()
    assert [h.holder() for h in hosts] == [None, None, "their-run"]
    assert "another deploy is changing this fleet, so nothing was changed on any host" in run.failure
    assert "ana@laptop-2 (pyinfra pid 4242, run their-run: deploy.py) since " in run.failure
    assert " ago), found on spark-3" in run.failure
    assert "if it no longer runs (killed, its controller gone): sparkfleet unlock <inventory>" in run.failure


def test_a_first_host_held_by_another_run_stops_the_run_before_the_others_are_asked(fleet):
    state, hosts = fleet
    program(hosts[0].lock, "take", {"holder": asdict(holder("their-run")), "stale": ""})
    oplock._take_all(state, oplock._run(state))
    assert hosts[1].commands == hosts[2].commands == 0


def test_a_dead_run_of_this_controller_is_taken_over_with_a_warning(fleet, caplog):
    state, hosts = fleet
    dead = oplock.Holder(run="dead-run", user="ana", controller="here", machine=oplock.machine_id(), pid=dead_pid())
    for h in hosts:
        program(h.lock, "take", {"holder": asdict(dead), "stale": ""})
    run = oplock._run(state)
    with caplog.at_level(logging.WARNING, logger="pyinfra"):
        oplock._take_all(state, run)
    assert not run.failure and {h.holder() for h in hosts} == {run.mine.run}
    assert "operator lock: taken over from ana@here" in caplog.text and "no longer runs on this controller" in caplog.text
    assert [h.commands for h in hosts] == [2, 1, 1]  # the others were told the dead run up front


def test_a_live_run_of_this_controller_is_not_taken_over(fleet):
    state, hosts = fleet
    alive = oplock.Holder(run="live-run", machine=oplock.machine_id(), pid=os.getpid())
    program(hosts[1].lock, "take", {"holder": asdict(alive), "stale": ""})
    run = oplock._run(state)
    oplock._take_all(state, run)
    assert run.failure and hosts[1].holder() == "live-run" and hosts[0].holder() is None


# --- sparkfleet unlock ------------------------------------------------------------------------


def test_unlock_shows_then_removes_exactly_what_it_showed(fleet):
    state, hosts = fleet
    program(hosts[0].lock, "take", {"holder": asdict(holder("their-run")), "stale": ""})
    program(hosts[2].lock, "take", {"holder": asdict(holder("their-run")), "stale": ""})
    lines, free, answered = unlock.unlock(state, show_only=True)
    assert answered and not free and [h.holder() for h in hosts] == ["their-run", None, "their-run"]
    assert lines[0].startswith("spark-1: held by ana@laptop-2 (pyinfra pid 4242, run their-run")
    assert "taken on another controller" in lines[0] and lines[1] == "spark-2: free"
    lines, free, answered = unlock.unlock(state)
    assert free and answered and [h.holder() for h in hosts] == [None, None, None]
    assert lines[0].endswith(": removed") and lines[2].endswith(": removed")


def test_unlock_keeps_a_lock_whose_pyinfra_still_runs_here_unless_forced(fleet):
    state, hosts = fleet
    alive = oplock.Holder(run="live-run", machine=oplock.machine_id(), pid=os.getpid())
    program(hosts[0].lock, "take", {"holder": asdict(alive), "stale": ""})
    lines, free, _ = unlock.unlock(state)
    assert not free and hosts[0].holder() == "live-run" and "still runs on this controller" in lines[0]
    lines, free, _ = unlock.unlock(state, force=True)
    assert free and hosts[0].holder() is None


def test_unlock_says_a_host_it_cannot_reach_keeps_its_lock(fleet):
    state, hosts = fleet
    state.active_hosts.discard(hosts[1])
    lines, free, answered = unlock.unlock(state)
    assert not free and not answered
    assert lines[1] == "spark-2: unreachable: its lock, if any, stays (a reboot of the host frees it)"


def test_the_answer_is_read_past_anything_printed_before_it():
    lines = ["a login banner", "now 1796000000.25", "done 1", '{"run": "run-a", "since": 1796000000.25}']
    assert oplock.answer(lines) == {"held": {"run": "run-a", "since": 1796000000.25}, "now": 1796000000.25,
                                    "done": True}
    assert oplock.answer(["now 5", "done 0", ""])["held"] is None  # empty: free
    with pytest.raises(OperationError, match="the lock program answered"):
        oplock.answer(["sh: 1: flock: not found"])


def test_a_lock_another_run_held_at_the_read_stops_the_run_though_it_was_freed_since(fleet):
    """The run planned on a state another run was changing: that run's changes may be
    missing from the plan, so nothing is taken and every host stops, naming it."""
    state, hosts = fleet
    run = oplock._run(state)
    run.read_held = {"spark-2": holder("their-run")}  # found by spark-2's first read; free now
    oplock._take_all(state, run)
    assert run.taken == set() and [h.commands for h in hosts] == [0, 0, 0]
    assert "another deploy is changing this fleet, so nothing was changed on any host" in run.failure
    assert "ana@laptop-2 (pyinfra pid 4242, run their-run: deploy.py)" in run.failure
    assert "found on spark-2" in run.failure


def test_planning_notes_a_lock_another_live_run_held_at_the_read(monkeypatch):
    from pyinfra.context import ctx_host
    from support.fleetdata import fake_state, host_answering

    dead = oplock.Holder(run="dead-run", machine=oplock.machine_id(), pid=dead_pid())
    for record, noted, taken_over in ((asdict(holder("their-run")), True, False), (asdict(dead), False, True),
                                      (None, False, False)):
        with fake_state(["@fake/spark-1"]) as state:
            target = state.inventory.get_host("@fake/spark-1")

            text = json.dumps(record) if record else ""
            monkeypatch.setattr(target, "get_fact", host_answering(texts={OPERATOR_LOCK: text}))
            with ctx_host.use(target):
                oplock._note_if_held()
            assert (oplock._run(state).read_held.get("@fake/spark-1") is not None) == noted
            assert ("@fake/spark-1" in oplock._run(state).read_dead) == taken_over


def test_a_run_takes_the_lock_at_its_first_change_on_every_host_it_has_not_done_with(fleet):
    """A converged run asks no host for the lock; the first command of any host takes every
    host pyinfra still has operations for, once, before that command runs."""
    state, hosts = fleet
    run = oplock._run(state)
    oplock._track(state, run)
    oplock._take_before_changes(state, run, after="op-lock")
    assert state.commands(hosts[0], "op-preflight") == [] and [h.commands for h in hosts] == [0, 0, 0]
    oplock._GiveBack.operation_host_success(state, hosts[0], "op-last-spark-1")  # spark-1: done, unchanged
    state.planned[("spark-2", "op-preflight")] = ["echo one", "echo two"]
    state.planned[("spark-3", "op-preflight")] = ["echo three"]
    assert state.commands(hosts[1], "op-preflight") == ["echo one", "echo two"]
    assert run.taken == {"spark-2", "spark-3"} and [h.holder() for h in hosts] == [None, run.mine.run, run.mine.run]
    assert state.commands(hosts[2], "op-preflight") == ["echo three"]
    assert [h.commands for h in hosts] == [0, 1, 1]  # taken once, for every host
    oplock._GiveBack.operation_host_success(state, hosts[1], "op-last-spark-2")
    assert [h.holder() for h in hosts] == [None, None, run.mine.run]


def test_another_runs_lock_at_the_first_change_fails_each_host_at_its_first_command(fleet):
    state, hosts = fleet
    program(hosts[2].lock, "take", {"holder": asdict(holder("their-run")), "stale": ""})
    run = oplock._run(state)
    oplock._track(state, run)
    oplock._take_before_changes(state, run, after="op-lock")
    state.planned[("spark-1", "op-preflight")] = ["echo change"]
    state.planned[("spark-2", "op-last-spark-2")] = ["echo later"]
    for target, op_hash in ((hosts[0], "op-preflight"), (hosts[1], "op-last-spark-2")):
        (failed,) = state.commands(target, op_hash)  # the failure, in place of the change
        assert "another deploy is changing this fleet, so nothing was changed on any host" in str(failed)
        assert "run their-run: deploy.py" in str(failed)
    assert run.taken == set() and [h.holder() for h in hosts] == [None, None, "their-run"]
