"""Rolling changes: a change that restarts the engine of a serving fleet rolls through it.

pyinfra runs an operation on every host at once, in one greenlet per host, with a barrier
between operations. The restart of a serving host is therefore one FunctionCommand
(:func:`rolled`) that first waits for its turn: hosts roll ``rollout_batch`` at a time, in
inventory order, each batch after the previous one has ended. A turn is: drain the host
from the fleet endpoint (no new requests; its in-flight ones finish, up to
``drain_timeout_s``), restart, wait for READY, gate, back in rotation.

The gate, from the controller against the host's API: the smoke check (Paris), a tool-call
round trip (bench/onhost/checks.py) and a decode request, whose rate must reach
``rollout_min_decode_tok_s``; for a speculative profile, the acceptance length those
requests got (from ``/metrics``) must reach ``rollout_min_acceptance``.

A host whose new settings do not get READY or fail the gate is rolled back to its last good
settings (service.py keeps them on the host), gated again and put back; the rollout then
stops: the hosts still waiting get their files put back to what they run (no restart) and
fail naming the host that stopped it. Their running service is untouched, so the next
deploy (after the data is fixed) rolls them, and skips hosts that already run the new
settings: it resumes where it stopped.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import gevent
import gevent.event
from pyinfra import host as current_host
from pyinfra import logger
from pyinfra.api.exceptions import OperationError
from pyinfra.api.host import Host

from sparkfleet import credentials, endpoint, haproxy, ready, remote
from sparkfleet.bench.onhost.checks import tool_call_round_trip
from sparkfleet.bench.onhost.client import BenchError, Client
from sparkfleet.bench.onhost.metrics import acceptance, parse_spec_counters
from sparkfleet.bench.onhost.workloads import SMOKE_EXPECT, SMOKE_MAX_TOKENS, SMOKE_PROMPT
from sparkfleet.config import Settings
from sparkfleet.fleet import reached_at
from sparkfleet.hostpaths import LAST_GOOD_DIR, REVISION_FILE, STARTED_FILE, UNIT
from sparkfleet.pairs import Pair
from sparkfleet.perrun import once

# How long a host put back in rotation may take to pass the endpoint's checks (rise 2 at 1 s).
BACK_TIMEOUT_S = 30
# Queries of the endpoint's members before a turn rolls without draining, and the pause between.
ENDPOINT_TRIES = 3
ENDPOINT_RETRY_S = 5
# Tokens of the gate's decode request: enough drafts for an acceptance length.
GATE_DECODE_TOKENS = 128
GATE_DECODE_PROMPT = "Write a short paragraph about the history of Paris."


class Stopped(OperationError):
    """The rollout stopped at a host: raised where a turn words why, so the connection
    check at the turn's end words it no second time."""

    def __init__(self, host_name: str, step: str, why: str):
        super().__init__(f"rollout stopped at {host_name}, step {step}: {why}")


@dataclass(frozen=True)
class Change:
    """What a turn changes between drain and READY other than the serving settings (the
    stack's packages, sparkfleet/stack.py), and how it goes back. It rolls as its own
    rollout (``kind``), so a run that also restarts for new settings rolls each apart.

    ``apply(host)`` and ``undo(host)`` run in the turn and return None once done, else why
    not (``apply``'s problem sends the host back as a failed gate does). ``proven(host)``,
    when there is one, is the gate's last step, on every member of a pair at once (its
    link measured again on the new stack); its problem fails the gate."""

    kind: str
    what: str  # the step, as messages name it
    back: str  # what the host runs once undone, as messages name it
    apply: Callable[[Host], str | None]
    undo: Callable[[Host], str | None]
    proven: Callable[[Host], str | None] | None = None
    reboots: bool = False  # the host reboots in its turn (a driver, a kernel)


@dataclass
class Rollout:
    """One deploy's rollout: who rolls, in which batch, and whether it stopped."""

    batch: int | list[int | str]  # rollout_batch: counts and shares of the hosts (batch_sizes)
    names: list[str] = field(default_factory=list)
    ended: dict[str, gevent.event.Event] = field(default_factory=dict)
    stopped: str | None = None  # "host (step)" that stopped it
    planning: int = 0  # hosts that planned their turn
    announced: bool = False
    #: A pair rolls as one, in its head's turn: head -> its headless members that roll,
    #: each with an event set once it is ready to be restarted.
    workers: dict[str, dict[str, gevent.event.Event]] = field(default_factory=dict)
    restarted: set[str] = field(default_factory=set)  # heads whose pair was restarted
    begun: set[str] = field(default_factory=set)  # hosts whose turn began: waited for until it ends
    #: A headless member's change, made in its head's turn (a stack upgrade of a pair).
    changes: dict[str, Change] = field(default_factory=dict)
    #: Hosts that roll after every other: the fleet endpoint's own host when its turn
    #: reboots it (HAProxy goes down with it), so a change that fails fails elsewhere first.
    last: set[str] = field(default_factory=set)

    def register(self, name: str, pair: Pair | None = None) -> None:
        slot = pair.head if pair is not None else name
        if pair is not None and pair.headless:
            self.workers.setdefault(slot, {}).setdefault(name, gevent.event.Event())
        if slot not in self.ended:
            self.names.append(slot)
            self.ended[slot] = gevent.event.Event()

    def batches(self, state) -> list[list[str]]:
        order = {h.name: i for i, h in enumerate(state.inventory)}
        names = sorted(self.names, key=lambda n: (n in self.last, order.get(n, len(order))))
        found, at = [], 0
        for size in batch_sizes(self.batch, len(names)):
            found.append(names[at:at + size])
            at += size
        return found

    def wait_turn(self, state, name: str) -> None:
        """Until every host of the earlier batches has ended its turn (or failed before it).

        A host whose turn began is waited for even once pyinfra counts it failed (a fact
        that lost its SSH connection fails the host while its turn still runs): its turn
        ends, and says whether the rollout stops, before the next host leaves the rotation.
        """
        for earlier in self.batches(state):
            if name in earlier:
                return
            for other in earlier:
                while not self.ended[other].wait(timeout=2):
                    other_host = state.inventory.get_host(other)
                    if other not in self.begun and other_host in state.failed_hosts:  # failed before its turn
                        break


def batch_sizes(steps: int | list[int | str], total: int) -> list[int]:
    """How many of ``total`` turns each batch takes: ``rollout_batch``'s counts and shares of
    ``total`` (rounded down, at least one), the last one repeating, as Ansible's ``serial``."""
    steps = steps if isinstance(steps, list) else [steps]
    sizes: list[int] = []
    while sum(sizes) < total:
        step = steps[min(len(sizes), len(steps) - 1)]
        size = int(step[:-1]) * total // 100 if isinstance(step, str) else int(step)
        sizes.append(max(1, min(size, total - sum(sizes))))
    return sizes


def batch_text(steps: int | list[int | str]) -> str:
    """``rollout_batch`` as the data says it: ``2``, ``1, 25%``."""
    return ", ".join(map(str, steps if isinstance(steps, list) else [steps]))


def rollout_of(state, settings: Settings, kind: str | None = None) -> Rollout:
    key = "rollout" if kind is None else f"rollout of {kind}"  # the run's own: perrun.once
    return once(key, lambda: Rollout(batch=settings.rollout_batch), state)


def planned(settings: Settings, pair: Pair | None = None, change: Change | None = None) -> None:
    """Register the current host for a rolling restart. While planning (pyinfra plans every
    host at once, in no fixed order), wait until every host has planned this far or ended,
    then say once which hosts roll in which batch (what --dry shows). A pair member rolls
    in its head's turn."""
    state = current_host.state
    ro = rollout_of(state, settings, change and change.kind)
    ro.register(current_host.name, pair)
    if change is not None and change.reboots and endpoint.endpoint_name(state) == current_host.name:
        ro.last.add(pair.head if pair is not None else current_host.name)
    if state.is_executing:  # the generator runs again to execute: planned already
        return
    ro.planning += 1
    deadline = time.monotonic() + 600
    while not ro.announced and ro.planning < len(state.pool) and time.monotonic() < deadline:
        gevent.sleep(0.1)
    if ro.announced:
        return
    ro.announced = True
    batches = ro.batches(state)
    what = change.what if change is not None else "restart"
    steps = (f"drain, {what}, gate, back in rotation" if endpoint.endpoint_name(state)
             else f"{what}, gate (no fleet endpoint)")
    for number, names in enumerate(batches, 1):
        for name in names:
            with_pair = "".join(f" with {w}" for w in ro.workers.get(name, {}))
            logger.info(f"{state.inventory.get_host(name).print_prefix}rolls in batch {number} of {len(batches)}"
                        f"{with_pair} (rollout_batch={batch_text(settings.rollout_batch)}): {steps}")


# --- one host's turn (controller side, in the host's greenlet) -------------------------------


def _worker_rolled(state, host, ro: Rollout, pair: Pair, revision: str | None, change: Change | None) -> bool:
    """A headless pair member's turn is its head's: it is restarted, or makes its ``change``
    (and, if need be, rolled back or goes back) with the head, which drains, waits for READY
    and gates the pair."""
    head = pair.head
    if change is None:
        remote.run(host, f"echo {revision} > {REVISION_FILE}")
    else:
        ro.changes[host.name] = change
    ro.workers[head][host.name].set()
    head_host = state.inventory.get_host(head)
    while not ro.ended[head].wait(timeout=2):
        if head_host in state.failed_hosts:  # failed before its turn
            break
    if head not in ro.restarted:
        kept = _keep_running_settings(host) if change is None else f"its {change.kind} untouched"
        raise OperationError(f"rollout: not changed — {head}, the head of {pair.group}, did not roll "
                             f"({ro.stopped or 'it failed first'}); this host serves what it ran ({kept}). "
                             "Fix the data and deploy again: the rollout resumes here.")
    if ro.stopped and ro.stopped.startswith(f"{head} "):
        raise OperationError(f"rollout: rolled with its head {head}, which stopped at {ro.stopped}: see {head}")
    host.log(f"rolled with its head {head}", logger.info)
    return True


def _pair_workers(state, ro: Rollout, host) -> tuple:
    """The headless members rolling with this head, once each is ready to restart."""
    workers = []
    for name, turn in ro.workers.get(host.name, {}).items():
        worker = state.inventory.get_host(name)
        while not turn.wait(timeout=2):
            if worker in state.failed_hosts:
                break
        if worker not in state.failed_hosts:
            workers.append(worker)
    return tuple(workers)


def rolled(state, host, settings: Settings, revision: str | None, pair: Pair | None = None,
           change: Change | None = None) -> bool:
    """Wait for this host's turn, then drain, restart (or make ``change``), gate and put it
    back. A pair rolls as one: its head drains, restarts every member (or makes each
    member's change), waits for READY and gates."""
    ro = rollout_of(state, settings, change and change.kind)
    if pair is not None and pair.headless:
        return _worker_rolled(state, host, ro, pair, revision, change)
    ro.wait_turn(state, host.name)
    step = "drain"
    try:
        ro.begun.add(host.name)
        peers = _pair_workers(state, ro, host) if pair is not None else ()
        if ro.stopped:
            kept = _keep_running_settings(host) if change is None else f"its {change.kind} untouched"
            raise OperationError(
                f"rollout: not changed — the rollout stopped at {ro.stopped}; this host serves what it ran "
                f"({kept}). Fix the data and deploy again: the rollout resumes here.")
        ep = _endpoint(state, host)
        out_since = time.monotonic()
        if ep is not None:
            left = haproxy.drain(ep, host.name, settings.drain_timeout_s)
            host.log(f"drained from the fleet endpoint in {time.monotonic() - out_since:.0f} s"
                     + (f" ({left} request(s) still in flight after drain_timeout_s)" if left else ""), logger.info)
        if change is not None:
            step = change.what
            ro.restarted.add(host.name)
            _changed(ep, host, settings, [(host, change), *((p, ro.changes[p.name]) for p in peers)],
                     pair=pair is not None)
            return True
        step = "restart"
        ro.restarted.add(host.name)
        waited = ready.ready_for(settings, host, pair=pair is not None)  # a pair's start is slower
        for peer in peers:  # the pair's members rejoin the head's new engine
            remote.run(peer, f"systemctl reset-failed {UNIT} 2>/dev/null; systemctl restart --no-block {UNIT}")
        done = remote.run(host, f"echo {revision} > {REVISION_FILE} && systemctl reset-failed {UNIT} 2>/dev/null; "
                                f"systemctl restart {UNIT}", timeout=300)
        if not done.ok:
            raise OperationError(f"rollout: systemctl restart {UNIT} failed: {' '.join(done.stderr)}")
        step = "READY"
        try:
            ready.wait_ready(state, host, *waited, restarting=True, peers=peers)  # rolls back
        except OperationError as exc:
            rolled_back = "rolled back: the last good settings serve again" in str(exc)
            _after_rollback(ep, host, settings, rolled_back)
            raise Stopped(host.name, "READY", str(exc)) from None
        step = "gate"
        problem = gate(host, settings)
        if problem:
            journal = ready.journal_tail(host)
            change = ready.change_from_last_good(host)
            host.log(f"gate failed ({problem}): rolling back to the last good settings ({change})", logger.warning)
            restored = ready.restore_last_good(host, peers)
            again = (ready.await_ready(host, *waited) if restored.ok
                     else "could not restore: " + " ".join(restored.stderr))
            _after_rollback(ep, host, settings, again is None)
            outcome = ("rolled back: the last good settings serve again" if again is None
                       else f"the rollback did not get READY either ({again})")
            raise Stopped(host.name, "gate", f"{problem}; {outcome}. Changed: {change} — fix that and deploy "
                          f"again\n    last lines of journalctl -u {UNIT} from the new settings:\n{journal}")
        step = "back in rotation"
        if ep is not None:
            endpoint.follows(state, host)  # its new address, port or key: the endpoint moves with its turn
            _back(ep, host)
            host.log(f"gate passed; back in rotation after {time.monotonic() - out_since:.0f} s out", logger.info)
        else:
            host.log("gate passed", logger.info)
        return True
    except BaseException as exc:
        if not ro.stopped:
            ro.stopped = f"{host.name} ({step})"
        # Power lost or the link cut in its turn: whatever the step was running when the
        # connection broke, one line says where the rollout stopped and why.
        if (isinstance(exc, Exception) and not isinstance(exc, Stopped) and step != "drain"
                and not remote.answers(host)):
            raise Stopped(host.name, step, remote.LOST) from None
        raise
    finally:
        ro.ended[host.name].set()


def _each(made: list[tuple[Host, Change]], step: str = "apply") -> str | None:
    """Every host's ``step`` of its change (apply, undo, proven): a pair's members at once,
    as they reboot together and meet in one measurement. None, or what failed where; an
    error raised on any (a host lost) is raised here."""
    if len(made) == 1:
        target, change = made[0]
        return getattr(change, step)(target)
    jobs = [gevent.spawn(getattr(change, step), target) for target, change in made]
    gevent.joinall(jobs)
    for job in jobs:
        if not job.successful():
            raise job.exception
    return "; ".join(f"{target.name}: {job.value}" for (target, _), job in zip(made, jobs) if job.value) or None


def _changed(ep, host, settings: Settings, made: list[tuple[Host, Change]], pair: bool) -> None:
    """A change's turn once drained: the change (on every member of a pair at once; ``pair``:
    the host heads one, its READY a pair's start), READY,
    the gate, back in rotation; where any fails, the change is undone, the host gated again
    and put back (or, when it cannot go back, left drained with its engine stopped), and the
    rollout stops."""
    change = made[0][1]
    out_since = time.monotonic()
    step, problem = change.what, _each(made)
    if problem is None:
        step, problem = "READY", ready.await_ready(host, *ready.ready_for(settings, host, pair=pair))
    if problem is None:
        step, problem = "gate", gate(host, settings)
    if problem is None and all(c.proven for _, c in made):
        step, problem = "gate (the pair's link)", _each(made, "proven")
    if problem is None:
        if ep is not None:
            _back(ep, host)
        host.log(f"{change.what}: gate passed" + (f"; back in rotation after {time.monotonic() - out_since:.0f} s"
                                                  if ep is not None else ""), logger.info)
        return
    journal = ready.journal_tail(host)
    host.log(f"{step} failed ({problem}): going back to {change.back}", logger.warning)
    why_not = _each(made, "undo")
    again = why_not or ready.await_ready(host, *ready.ready_for(settings, host, pair=pair))
    if again is None:
        _after_rollback(ep, host, settings, True)
        outcome = f"went back: {change.back} serves again"
    else:
        for target, _ in made:  # a pair's members all: a worker alone would restart into a missing head
            remote.run(target, f"systemctl stop {UNIT}")
        outcome = f"could not go back ({again}): left drained, {UNIT} stopped"
    raise Stopped(host.name, step, f"{problem}; {outcome}. Fix the declared versions and deploy again\n"
                                   f"    last lines of journalctl -u {UNIT}:\n{journal}")


def _after_rollback(ep, host, settings: Settings, serving_again: bool) -> None:
    """A rolled-back host: gated again on its old settings, then back in rotation."""
    if not serving_again:
        host.log("the rollback did not get READY: left out of the fleet endpoint's rotation", logger.error)
        return
    # The old settings' own profile is not known here: smoke and tools, no acceptance floor.
    problem = gate(host, settings, acceptance_floor=False)
    if problem:
        host.log(f"the rolled-back settings fail the gate too ({problem}): left out of rotation", logger.error)
        return
    if ep is not None:
        _back(ep, host)
    host.log("rolled back, gated again" + (" and back in rotation" if ep is not None else ""), logger.warning)


def _endpoint(state, host):
    """The endpoint host when ``host`` is one of its members (None: no endpoint yet)."""
    ep = endpoint.endpoint_host(state)
    if ep is None:
        return None
    # A loaded endpoint host can miss one query: asked again before the turn rolls without
    # draining (its in-flight requests would fail); one the run cannot reach is not.
    for attempt in range(ENDPOINT_TRIES):
        try:
            members = haproxy.members_of(ep)
            break
        except OperationError as exc:
            if attempt + 1 == ENDPOINT_TRIES or not ep.connected:
                host.log(f"the fleet endpoint does not answer ({exc}): rolling without draining", logger.warning)
                return None
            gevent.sleep(ENDPOINT_RETRY_S)
    if haproxy.server_name(host.name) in members:
        return ep
    # Not in its rotation (not served yet, or left out by an earlier run): no client reaches
    # it through the endpoint, so there is nothing to drain; the endpoint step adds it later.
    host.log("not in the fleet endpoint's rotation: rolls without draining", logger.info)
    return None


def _back(ep, host) -> None:
    if not haproxy.ready(ep, host.name, timeout_s=BACK_TIMEOUT_S):
        raise Stopped(host.name, "back in rotation", "the fleet endpoint's checks did not pass within "
                                                     f"{BACK_TIMEOUT_S} s (see the endpoint's metrics)")


def _keep_running_settings(host) -> str:
    """Put back the files of a host that does not roll to what its service runs (no restart)."""
    running = remote.run(host, f"cat {STARTED_FILE}").stdout
    last_good = remote.run(host, f"cat {LAST_GOOD_DIR}/serving.rev").stdout
    if not running or running != last_good:
        return "its files are the new ones: no last good copy of what runs"
    restore = ready.restore_command(restart=False)
    done = remote.run(host, restore, timeout=120)
    return "files put back to them, no restart" if done.ok else f"could not put files back: {' '.join(done.stderr)}"


# --- the gate ---------------------------------------------------------------------------------


def api_url(host, settings: Settings) -> str:
    """The host's API as the controller reaches it: its bind address, else the address the
    controller's SSH connection reached it at."""
    address = ipaddress.ip_address(settings.bind_address)
    if address.is_loopback:
        raise OperationError(f"{host.name}: the rollout gate needs the API reachable from the controller, but "
                             f"bind_address is {settings.bind_address}; bind another address or use --data rollout=all")
    if address.is_unspecified:
        found = reached_at(host)
        address = ipaddress.ip_address(found) if _is_ip(found) else found
    text = f"[{address}]" if getattr(address, "version", 4) == 6 else str(address)
    return f"http://{text}:{settings.port}"


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def gate(host, settings: Settings, acceptance_floor: bool = True) -> str | None:
    """Smoke, tool-call round trip, then one decode request: its rate at or above
    ``rollout_min_decode_tok_s`` and (speculative profiles) its acceptance length at or above
    ``rollout_min_acceptance``. None, or what failed. ``acceptance_floor=False`` (a rollback's
    gate): smoke and tools only."""
    client = Client(api_url(host, settings), settings.served_model_name, credentials.api_key(settings), timeout=120)
    speculative = acceptance_floor and settings.speculative_method is not None
    try:
        before = parse_spec_counters(client.metrics_text()) if speculative else None
        data, _ = client.complete(SMOKE_PROMPT, SMOKE_MAX_TOKENS)
        answer = ((data.get("choices") or [{}])[0].get("text") or "")
        if SMOKE_EXPECT not in answer.lower():
            return f"smoke check: the answer does not contain Paris: {answer.strip()!r}"
        tools = tool_call_round_trip(client)
        if not tools["passed"]:
            return f"tools check: {tools['reason']}"
        if not acceptance_floor:
            host.log("gate: smoke, tools", logger.info)
            return None
        data, elapsed = client.complete(GATE_DECODE_PROMPT, GATE_DECODE_TOKENS)
        tokens = int((data.get("usage") or {}).get("completion_tokens") or 0)
        rate = tokens / elapsed if elapsed > 0 else 0.0
        if rate < settings.rollout_min_decode_tok_s:
            return (f"decode rate {rate:.1f} tok/s ({tokens} tokens in {elapsed:.1f} s) is below "
                    f"rollout_min_decode_tok_s {settings.rollout_min_decode_tok_s:g} (a GB10 decodes 28+ tok/s)")
        said = f"gate: smoke, tools, decode {rate:.1f} tok/s"
        if speculative:
            acc = acceptance(parse_spec_counters(client.metrics_text()) - before)
            if acc is None:
                return f"acceptance: {settings.profile} is speculative but /metrics counted no drafts"
            if acc["mean_length"] < settings.rollout_min_acceptance:
                return (f"acceptance length {acc['mean_length']:.2f} is below rollout_min_acceptance "
                        f"{settings.rollout_min_acceptance} (is the drafter the one for this model?)")
            said += f", acceptance length {acc['mean_length']:.2f}"
        host.log(said, logger.info)
    except BenchError as exc:
        return f"the API at {client.base_url} failed a gate request: {exc}"
    except OSError as exc:
        return f"the API at {client.base_url} is not reachable from the controller: {exc}"
    return None


def applies(settings: Settings, unit: dict[str, str], started: str | None, last_good: str | None) -> bool:
    """Whether this host's restart rolls: rollout=rolling and the host serves now.

    "Serves now" is the host's own record, not an API call with the new settings: the unit
    is active on the settings it started with (``started``), and those once got READY
    (``last_good``). Asked with a new key, port, bind address or served name, a serving
    engine would look dead and restart at once, with no drain and no gate.
    """
    return (settings.rollout == "rolling" and unit.get("ActiveState") == "active"
            and started is not None and started == last_good)
