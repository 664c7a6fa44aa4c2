"""READY and the last good settings: what the service step and rolling changes share.

READY is a real completion from the served model (not only ``/health``), polled until it
answers or the engine dies; a (re)start of ours that does not get there goes back to the
last settings that did (``LAST_GOOD_DIR``: serve.env, the unit, the runtime copy, the API
key files, the revision and the compile signature), on every member of a pair.
"""

from __future__ import annotations

import ipaddress
import shlex
import time

import gevent
from pyinfra import host, logger
from pyinfra.api import operation
from pyinfra.api.exceptions import OperationError

from sparkfleet import remote, snapshot
from sparkfleet.bench.onhost.workloads import SMOKE_PROMPT as READY_PROMPT  # READY asks what smoke asks
from sparkfleet.config import Settings
from sparkfleet.facts import EnginePhase, ServedAnswer, ServedModels, UnitState
from sparkfleet.fleet import reached_at
from sparkfleet.hostpaths import (
    AUTH_HEADER,
    COMPILE_SIGNATURE,
    LAST_GOOD_DIR,
    REVISION_FILE,
    RUNTIME_DIR,
    SECRETS_ENV,
    SERVE_ENV,
    UNIT,
    UNIT_PATH,
)
from sparkfleet.pairs import PairMember


def local_address(bind_address: str) -> str:
    """Where a client on the host itself reaches the API, ready for a URL."""
    address = ipaddress.ip_address(bind_address)
    if address.is_unspecified or address.is_loopback:
        return "127.0.0.1" if address.version == 4 or address.is_unspecified else "[::1]"
    return f"[{address}]" if address.version == 6 else str(address)


# --- READY --------------------------------------------------------------------------------


def wait_ready(state, host, address: str, port: int, model: str, timeout_s: int, hint: str,  # state, host: pyinfra's
                restarting: bool, peers: tuple = ()) -> bool:
    """Wait for READY; when a (re)start of ours does not get there, roll back (with
    ``peers``: the pair's other members, which run one engine with this host)."""
    failure = await_ready(host, address, port, model, timeout_s, hint)
    if failure is None:
        return True
    if lost(host):  # nothing to read or roll back on a host that does not answer
        raise OperationError(failure)
    journal = journal_tail(host)
    if not restarting:  # not our change: report, touch nothing
        raise OperationError(f"{failure} — its journal says why (below); fix that and deploy again\n"
                             f"    last lines of journalctl -u {UNIT}:\n{journal}")
    last_good = remote.run(host, f"cat {LAST_GOOD_DIR}/serving.rev").stdout
    if not last_good or last_good == remote.run(host, f"cat {REVISION_FILE}").stdout:
        for target in (*peers, host):
            remote.run(target, f"systemctl stop {UNIT}")
        raise OperationError(
            f"{failure}; nothing else got READY on this host before, so {UNIT} is stopped "
            f"(not left crash-looping) — fix the settings and deploy again\n"
            f"    last lines of journalctl -u {UNIT}:\n{journal}"
        )
    change = change_from_last_good(host)
    host.log(f"{failure}: rolling back to the last good settings ({change})", logger.warning)
    restored = restore_last_good(host, peers)
    again = (await_ready(host, address, port, model, timeout_s, hint) if restored.ok
             else "could not restore: " + " ".join(restored.stderr))
    outcome = (
        "rolled back: the last good settings serve again" if again is None
        else f"the rollback did not get READY either ({again})"
    )
    raise OperationError(
        f"the new settings did not get READY ({failure}); {outcome}. Changed: {change} — "
        f"fix that and deploy again\n    last lines of journalctl -u {UNIT} from the failed start:\n{journal}"
    )


def await_ready(host, address: str, port: int, model: str, timeout_s: int, hint: str) -> str | None:
    """Poll until the served model answers a real request: None, or why it did not."""
    started = time.monotonic()
    last_report = started
    # A unit's state is anyone's to read (systemd's D-Bus API): no sudo, no password hash
    # on the host every poll.
    restarts_before = host.get_fact(UnitState, unit=UNIT, _sudo=False).get("NRestarts", "0")
    while True:
        answer = host.get_fact(ServedAnswer, address=address, port=port, model=model, prompt=READY_PROMPT)
        if lost(host):
            return remote.LOST
        elapsed = time.monotonic() - started
        if answer is not None:
            host.log(f"READY in {elapsed:.0f} s — {hint}", logger.info)
            return None
        unit = host.get_fact(UnitState, unit=UNIT, _sudo=False)
        # A restart while we wait means the engine died: its log says why, waiting won't.
        if unit.get("ActiveState") in ("failed", "inactive"):
            return f"the engine exited ({UNIT} {unit.get('ActiveState')})"
        if unit.get("NRestarts", "0") != restarts_before:
            return f"the engine exited and systemd restarted it ({UNIT} {unit.get('SubState')})"
        if elapsed > timeout_s:
            return f"not READY after {timeout_s} s (ready_timeout_s; raise it for slow first starts)"
        if time.monotonic() - last_report >= 15:
            last_report = time.monotonic()
            phase = host.get_fact(EnginePhase, unit=UNIT) or f"unit {unit.get('ActiveState')}"
            host.log(f"waiting for READY: {elapsed:.0f} s, {phase}", logger.info)
        gevent.sleep(1)  # the poll itself waited on the host (ServedAnswer)




def lost(target_host) -> bool:
    """Whether this run lost ``target_host``: a fact that could not reach it failed it."""
    return target_host in target_host.state.failed_hosts or not target_host.connected


def change_from_last_good(host) -> str:
    """What differs between the last good settings and the failing ones, in words."""
    def env(path: str) -> dict[str, str]:
        lines = remote.run(host, f"cat {path}").stdout
        return dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("#"))

    old, new = env(f"{LAST_GOOD_DIR}/serve.env"), env(SERVE_ENV)
    changes = [f"{key} {old.get(key, '(unset)')!r} -> {new.get(key, '(unset)')!r}"
               for key in sorted(old.keys() | new.keys()) if old.get(key) != new.get(key)]
    if not remote.run(host, f"cmp -s {LAST_GOOD_DIR}/unit {UNIT_PATH}").ok:
        changes.append(f"the unit ({UNIT_PATH}: image or mounts)")
    if not remote.run(host, f"diff -rq {LAST_GOOD_DIR}/runtime {RUNTIME_DIR}").ok:
        changes.append(f"the runtime copy ({RUNTIME_DIR})")
    if not remote.run(host, f"cmp -s {LAST_GOOD_DIR}/secrets.env {SECRETS_ENV}").ok:
        changes.append("the API key")
    return "; ".join(changes) or "the compile cache"


def keep_command(cache: str) -> str:
    """Shell: copy what serves now into LAST_GOOD_DIR, atomically."""
    new = f"{LAST_GOOD_DIR}.new"
    return " && ".join([
        f"rm -rf {new}", f"mkdir -p {new}",
        f"cp {SERVE_ENV} {new}/serve.env", f"cp {UNIT_PATH} {new}/unit", f"cp {REVISION_FILE} {new}/serving.rev",
        f"cp -a {RUNTIME_DIR} {new}/runtime",
        # The key is part of what serves: a rollback must restore the key clients and checks use.
        f"install -m 0600 {SECRETS_ENV} {new}/secrets.env", f"install -m 0600 {AUTH_HEADER} {new}/api-auth.header",
        f"echo {shlex.quote(cache)} > {new}/compile.path",
        f"{{ cp {shlex.quote(cache)}/{COMPILE_SIGNATURE} {new}/compile-signature 2>/dev/null || true; }}",
        f"rm -rf {LAST_GOOD_DIR}", f"mv {new} {LAST_GOOD_DIR}",
    ])


def restore_last_good(host, peers: tuple = ()):
    """Put the last good settings back on ``host`` and its pair's ``peers``, restarting
    each: a pair's members must run the same settings to join."""
    for peer in peers:
        remote.run(peer, restore_command(), timeout=300)
    return remote.run(host, restore_command(), timeout=300)


def restore_command(restart: bool = True) -> str:
    """Shell: put the last good settings back and (``restart``) restart on them; without,
    the files only, for a host whose service already runs them."""
    lg = LAST_GOOD_DIR
    return "\n".join([
        "set -e",
        f"cp {lg}/serve.env {SERVE_ENV}",
        f"if ! cmp -s {lg}/unit {UNIT_PATH}; then cp {lg}/unit {UNIT_PATH}; "
        f"systemctl daemon-reload; systemctl reenable {UNIT}; fi",
        f"rm -rf {RUNTIME_DIR}.restore && cp -a {lg}/runtime {RUNTIME_DIR}.restore",
        f"rm -rf {RUNTIME_DIR} && mv {RUNTIME_DIR}.restore {RUNTIME_DIR}",
        f"if [ -f {lg}/secrets.env ]; then install -m 0600 {lg}/secrets.env {SECRETS_ENV}; "
        f"install -m 0600 {lg}/api-auth.header {AUTH_HEADER}; fi",
        # The failed start may have compiled for its own graph: clear what no longer matches.
        f'cache=$(cat {lg}/compile.path); if ! cmp -s {lg}/compile-signature "$cache/{COMPILE_SIGNATURE}"; then '
        f'rm -rf "$cache/torch_compile_cache"; cp {lg}/compile-signature "$cache/{COMPILE_SIGNATURE}" || true; fi',
        f"cp {lg}/serving.rev {REVISION_FILE}",
        *([f"systemctl reset-failed {UNIT} 2>/dev/null || true", f"systemctl restart {UNIT}"] if restart else []),
    ])


def ready_address(settings: Settings, member: PairMember | None) -> str:
    """Where the host itself asks for READY: its own API, or for a headless pair member
    its head's, over the link (it serves no HTTP; it is READY when its pair answers)."""
    if member is not None and member.pair.headless:
        return member.pair.master_addr
    return local_address(settings.bind_address)


def ready_for(settings: Settings, target_host, member: PairMember | None = None, pair: bool = False) -> tuple:
    """The READY wait's arguments for ``settings`` on ``target_host``: (address, port,
    model, timeout_s, hint), for :func:`wait_ready` / :func:`await_ready` outside
    ``service.running``; ``pair``: the host heads a pair (a member: one by its ``member``)."""
    return (ready_address(settings, member), settings.port, settings.served_model_name,
            settings.ready_wait_s(pair=pair or member is not None), endpoint_hint(settings, target_host, member))


def endpoint_hint(settings: Settings, target_host=None, member: PairMember | None = None) -> str:
    if member is not None and member.pair.headless:
        return (f"rank {member.pair.rank} of {member.pair.group} (headless): {member.pair.head} serves the pair "
                f"at port {settings.port}")
    mode = settings.api_key.get_secret_value()
    key = (
        f"API key in {settings.api_key_file}" if mode == "auto"
        else "no API key (api_key=none)" if mode == "none" else "API key as configured"
    )
    address = reached_at(target_host or host)
    return f"http://{address}:{settings.port}/v1 serves `{settings.served_model_name}` ({settings.profile}); {key}"


def journal_tail(target_host, lines: int = 25) -> str:
    tail = remote.run(target_host, f"journalctl -u {UNIT} -n {lines} --no-pager -o cat 2>&1 | tail -n {lines}")
    return "    " + "\n    ".join(tail.stdout or ["(journal is empty)"])


def declared(address: str, port: int) -> None:
    """Declare, while the deploy plans, what :func:`ready` reads (the models the API lists):
    the host's snapshot reads it with the rest, not in a command (and a sudo) of its own."""
    snapshot.expect(facts=[(ServedModels, {"address": address, "port": port})])


@operation(is_idempotent=False)
def ready(address: str, port: int, model: str, timeout_s: int, restarting: bool, hint: str):
    """
    Wait until the served model answers a real request (not only /health).

    + address, port: where the API answers on the host itself
    + model: the served model name
    + timeout_s: how long a (re)start may take (``ready_timeout_s``)
    + restarting: whether this run (re)starts the service, so a current answer is stale
    + hint: the endpoint line printed once READY
    """
    # Cheap while planning (and under --dry): the API lists the model. After a (re)start
    # the wait below asks for a real completion.
    if not restarting and model in snapshot.fact(ServedModels, address=address, port=port):
        host.noop(f"READY — {hint}")
        return
    yield remote.callback(wait_ready, address, port, model, timeout_s, hint, restarting)


@operation()
def last_good_kept(revision: str, hf_home: str):
    """
    Keep the settings that just got READY as the host's last good ones, for rollback.

    + revision: the revision now serving
    + hf_home: where the compile cache lives (its signature is kept too)
    """
    if snapshot.first_line(f"{LAST_GOOD_DIR}/serving.rev") == revision:
        host.noop("the last good settings are these")
        return
    yield keep_command(f"{hf_home}/.vllm_cache")
