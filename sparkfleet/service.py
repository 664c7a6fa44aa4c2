"""The serving service: one systemd unit running the serving container, then READY.

Everything the container reads is a file the deploy owns: the unit, ``serve.env``
(profile settings), ``secrets.env`` (0600) and the ``runtime/`` copy. The unit is
reloaded only when it changed; the service is (re)started when what it runs differs from
what is on disk — once per host, however many inputs changed — and a start of ours that
does not get READY is rolled back to the last settings that did.
"""

from __future__ import annotations

import hashlib
import io
import ipaddress
import shlex
import time
from pathlib import Path

import gevent
from pydantic import SecretStr
from pyinfra import host, logger
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.api.util import get_template
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import server

from sparkfleet import container_runtime, remote, rollout, secrets, snapshot
from sparkfleet.bench.onhost.workloads import SMOKE_PROMPT as READY_PROMPT  # READY asks what smoke asks
from sparkfleet.config import Settings
from sparkfleet.facts import PortHolders, ServedAnswer, ServedModels, UnitState
from sparkfleet.fleet import PairMember, reached_at
from sparkfleet.hostpaths import (
    AUTH_HEADER,
    COMPILE_SIGNATURE,
    CONTAINER,
    HF_ENV,
    LAST_GOOD_DIR,
    RDMA_DEVICES,
    REVISION_FILE,
    RUNTIME_DIR,
    SECRETS_ENV,
    SERVE_ENV,
    STARTED_FILE,
    UNIT,
    UNIT_PATH,
)
from sparkfleet.mirror import local_image

PROJECT = Path(__file__).resolve().parents[1]
TEMPLATES = PROJECT / "templates"


def memory_needed(settings: Settings) -> float:
    """The share of the host's memory the service will claim when it starts (vLLM takes
    ``gpu_memory_utilization`` of the unified memory); 0 once our own server runs, as that
    memory is already ours."""
    running = host.get_fact(SystemdStatus, services=UNIT).get(UNIT, False)
    return 0.0 if running else settings.gpu_memory_utilization


def port_problem(settings: Settings) -> str | None:
    """Why the service could not bind its port here, or None: the port is free or held
    by our own serving container."""
    holders = host.get_fact(PortHolders, port=settings.port, container=CONTAINER)
    if not holders:
        return None
    return (f"port {settings.port} is held by {', '.join(holders)}: stop that process, or choose "
            "another port with --data port=N")


def local_address(bind_address: str) -> str:
    """Where a client on the host itself reaches the API, ready for a URL."""
    address = ipaddress.ip_address(bind_address)
    if address.is_unspecified or address.is_loopback:
        return "127.0.0.1" if address.version == 4 or address.is_unspecified else "[::1]"
    return f"[{address}]" if address.version == 6 else str(address)


# --- private files ------------------------------------------------------------------------


def _private_file(path: str, content: str):
    """Commands that make ``path`` hold ``content``, 0600 root, unless it does. The
    content never appears in argv, output or diffs: only its hash is compared."""
    wanted = hashlib.sha256(content.encode()).hexdigest()
    if (snapshot.file_state(path) or (None, None, None))[2] == wanted:
        return
    directory = path.rsplit("/", 1)[0]
    yield f"install -d -m 0755 {directory}"
    # 0600 from the first byte, never a world-readable upload in /tmp (remote.put).
    yield remote.callback(remote.uploaded, io.BytesIO(content.encode()), path, "0600")


def _api_key_files(api_key: str | None) -> dict[str, str]:
    return {
        SECRETS_ENV: f"VLLM_API_KEY={api_key}\n" if api_key else "",
        AUTH_HEADER: f"Authorization: Bearer {api_key}\n" if api_key else "",
    }


def _write_new_api_key(state, host, api_key: SecretStr, key_file: Path) -> bool:  # pyinfra passes state, host
    """At execute time: make the project's ``auto`` key (once), then its 0600 host files."""
    key = secrets.make_api_key(api_key, key_file)
    for path, content in _api_key_files(key).items():
        directory = path.rsplit("/", 1)[0]
        remote.run(host, f"install -d -m 0755 {directory} && install -m 0600 /dev/null {path}")
        remote.put(host, content.encode(), path, mode="0600")
    return True


@operation()
def api_key_written(api_key: SecretStr, key_file: Path):
    """
    Write the API key into the root-only files the serving container and checks read.

    + api_key: ``auto`` (the project's key in ``key_file``, made on the first deploy),
      ``none`` or the key itself
    + key_file: where the controller keeps the ``auto`` key
    """
    try:
        key = secrets.existing_api_key(api_key, key_file)
    except secrets.NotYetMade:  # made when the deploy executes, never while it plans
        yield remote.callback(_write_new_api_key, api_key, key_file)
        return
    for path, content in _api_key_files(key).items():
        yield from _private_file(path, content)


@operation()
def hf_token_written(token: SecretStr | None, removed: bool):
    """
    Write the HF token into the root-only file that downloads and builds read.

    + token: the token (``hf_token``, else the controller's HF_TOKEN), or None
    + removed: ``hf_token`` was set empty: remove the host's token

    Serving never reads it (it starts offline), so it is no restart input; and a controller
    without a token leaves the hosts' token alone (``--data hf_token=`` removes it).
    """
    if token is None and not removed:
        if snapshot.file_state(HF_ENV) is None:
            yield from _private_file(HF_ENV, "")
        return
    yield from _private_file(HF_ENV, f"HF_TOKEN={token.get_secret_value()}\n" if token else "")


@operation()
def compile_cache_matches(hf_home: str, signature: str):
    """
    Clear vLLM's torch.compile cache when what it was compiled for changed.

    + hf_home: the HF cache, holding vLLM's cache in ``.vllm_cache``
    + signature: what the cache depends on (``Settings.compile_signature``)

    A cache compiled for another graph crashes the next start (seen in the reference recipe).
    """
    cache = f"{hf_home}/.vllm_cache"
    signature_file = f"{cache}/{COMPILE_SIGNATURE}"
    if snapshot.first_line(signature_file) == signature:
        return
    yield f"rm -rf {shlex.quote(cache + '/torch_compile_cache')}"
    yield f"mkdir -p {shlex.quote(cache)}"
    yield StringCommand("echo", shlex.quote(signature), ">", shlex.quote(signature_file))


# --- READY --------------------------------------------------------------------------------


def _wait_ready(state, host, address: str, port: int, model: str, timeout_s: int, hint: str,  # state, host: pyinfra's
                restarting: bool, peers: tuple = ()) -> bool:
    """Wait for READY; when a (re)start of ours does not get there, roll back (with
    ``peers``: the pair's other members, which run one engine with this host)."""
    failure = _await_ready(host, address, port, model, timeout_s, hint)
    if failure is None:
        return True
    journal = _journal_tail(host)
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
    change = _change_from_last_good(host)
    host.log(f"{failure}: rolling back to the last good settings ({change})", logger.warning)
    restored = restore_last_good(host, peers)
    again = (_await_ready(host, address, port, model, timeout_s, hint) if restored.ok
             else "could not restore: " + " ".join(restored.stderr))
    outcome = (
        "rolled back: the last good settings serve again" if again is None
        else f"the rollback did not get READY either ({again})"
    )
    raise OperationError(
        f"the new settings did not get READY ({failure}); {outcome}. Changed: {change} — "
        f"fix that and deploy again\n    last lines of journalctl -u {UNIT} from the failed start:\n{journal}"
    )


def _await_ready(host, address: str, port: int, model: str, timeout_s: int, hint: str) -> str | None:
    """Poll until the served model answers a real request: None, or why it did not."""
    started = time.monotonic()
    last_report = started
    restarts_before = host.get_fact(UnitState, unit=UNIT).get("NRestarts", "0")
    while True:
        answer = host.get_fact(ServedAnswer, address=address, port=port, model=model, prompt=READY_PROMPT)
        elapsed = time.monotonic() - started
        if answer is not None:
            host.log(f"READY in {elapsed:.0f} s — {hint}", logger.info)
            return None
        unit = host.get_fact(UnitState, unit=UNIT)
        # A restart while we wait means the engine died: its log says why, waiting won't.
        if unit.get("ActiveState") in ("failed", "inactive"):
            return f"the engine exited ({UNIT} {unit.get('ActiveState')})"
        if unit.get("NRestarts", "0") != restarts_before:
            return f"the engine exited and systemd restarted it ({UNIT} {unit.get('SubState')})"
        if elapsed > timeout_s:
            return f"not READY after {timeout_s} s (ready_timeout_s; raise it for slow first starts)"
        if time.monotonic() - last_report >= 15:
            last_report = time.monotonic()
            host.log(f"waiting for READY: {elapsed:.0f} s, unit {unit.get('ActiveState')}", logger.info)
        gevent.sleep(2)


def _change_from_last_good(host) -> str:
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
    return "; ".join(changes) or "the API key or the compile cache"


def _snapshot_last_good(cache: str) -> str:
    """Shell: copy what serves now into LAST_GOOD_DIR, atomically."""
    new = f"{LAST_GOOD_DIR}.new"
    return " && ".join([
        f"rm -rf {new}", f"mkdir -p {new}",
        f"cp {SERVE_ENV} {new}/serve.env", f"cp {UNIT_PATH} {new}/unit", f"cp {REVISION_FILE} {new}/serving.rev",
        f"cp -a {RUNTIME_DIR} {new}/runtime",
        f"echo {shlex.quote(cache)} > {new}/compile.path",
        f"{{ cp {shlex.quote(cache)}/{COMPILE_SIGNATURE} {new}/compile-signature 2>/dev/null || true; }}",
        f"rm -rf {LAST_GOOD_DIR}", f"mv {new} {LAST_GOOD_DIR}",
    ])


def restore_last_good(host, peers: tuple = ()):
    """Put the last good settings back on ``host`` and its pair's ``peers``, restarting
    each: a pair's members must run the same settings to join."""
    for peer in peers:
        remote.run(peer, _restore_last_good(), timeout=300)
    return remote.run(host, _restore_last_good(), timeout=300)


def _restore_last_good() -> str:
    """Shell: put the last good settings back and restart on them."""
    lg = LAST_GOOD_DIR
    return "\n".join([
        "set -e",
        f"cp {lg}/serve.env {SERVE_ENV}",
        f"if ! cmp -s {lg}/unit {UNIT_PATH}; then cp {lg}/unit {UNIT_PATH}; "
        f"systemctl daemon-reload; systemctl reenable {UNIT}; fi",
        f"rm -rf {RUNTIME_DIR}.restore && cp -a {lg}/runtime {RUNTIME_DIR}.restore",
        f"rm -rf {RUNTIME_DIR} && mv {RUNTIME_DIR}.restore {RUNTIME_DIR}",
        # The failed start may have compiled for its own graph: clear what no longer matches.
        f'cache=$(cat {lg}/compile.path); if ! cmp -s {lg}/compile-signature "$cache/{COMPILE_SIGNATURE}"; then '
        f'rm -rf "$cache/torch_compile_cache"; cp {lg}/compile-signature "$cache/{COMPILE_SIGNATURE}" || true; fi',
        f"cp {lg}/serving.rev {REVISION_FILE}",
        f"systemctl reset-failed {UNIT} 2>/dev/null || true",
        f"systemctl restart {UNIT}",
    ])


def ready_address(settings: Settings, member: PairMember | None) -> str:
    """Where the host itself asks for READY: its own API, or for a headless pair member
    its head's, over the link (it serves no HTTP; it is READY when its pair answers)."""
    if member is not None and member.pair.headless:
        return member.pair.master_addr
    return local_address(settings.bind_address)


def ready_for(settings: Settings, target_host, member: PairMember | None = None) -> tuple:
    """The READY wait's arguments for ``settings`` on ``target_host``: (address, port,
    model, timeout_s, hint), for ``_wait_ready`` / ``_await_ready`` outside ``running``."""
    return (ready_address(settings, member), settings.port, settings.served_model_name,
            settings.ready_timeout_s, _endpoint_hint(settings, target_host, member))


def _endpoint_hint(settings: Settings, target_host=None, member: PairMember | None = None) -> str:
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


def _journal_tail(target_host, lines: int = 25) -> str:
    tail = remote.run(target_host, f"journalctl -u {UNIT} -n {lines} --no-pager -o cat 2>&1 | tail -n {lines}")
    return "    " + "\n    ".join(tail.stdout or ["(journal is empty)"])


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
    if model in host.get_fact(ServedModels, address=address, port=port) and not restarting:
        host.noop(f"READY — {hint}")
        return
    yield remote.callback(_wait_ready, address, port, model, timeout_s, hint, restarting)


def _render(template: str, **context) -> str:
    """A file of templates/, rendered as pyinfra's files.template renders it."""
    return get_template(str(TEMPLATES / template)).render(context)


def _tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def revision(env_text: str, unit_text: str, compile_signature: str) -> str:
    """One hash of what the serving container runs: serve.env, the unit, the runtime copy
    and the compile signature. (A new API key restarts through its own operation: the key
    may be made only when the deploy executes.)"""
    parts = (env_text, unit_text, _tree_hash(PROJECT / "runtime"), compile_signature)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@operation()
def serving(revision: str, restart: bool, rolling: Settings | None = None, member: PairMember | None = None):
    """
    The service runs the settings on disk: (re)started unless it already runs exactly them.

    + revision: hash of everything the service runs (``revision()``)
    + restart: an input the hash does not cover changed (a rebuilt checkpoint)
    + rolling: this serving host's settings when its restart rolls (rollout.py): it waits
      for its batch, is drained, restarted, gated and put back
    + member: the host's place in its pair, if any: a pair rolls as one

    One decision from the unit's own record of what it started with, so a host in any
    state (crash loop, failed, stopped, restarting on its own) converges in one run.
    """
    active = snapshot.unit(UNIT).get("ActiveState") == "active"
    if not restart and active and snapshot.first_line(STARTED_FILE) == revision:
        host.noop(f"{UNIT} runs these settings")
        return
    if rolling is not None:
        rollout.planned(rolling, member)
        yield remote.callback(rollout.rolled, rolling, revision, member)
        return
    yield StringCommand("echo", revision, ">", REVISION_FILE)
    # A crash loop's start limit must not block the deploy's own start.
    yield f"systemctl reset-failed {UNIT} 2>/dev/null; systemctl restart {UNIT}"


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
    yield _snapshot_last_good(f"{hf_home}/.vllm_cache")


# --- the state ----------------------------------------------------------------------------


@deploy("Host files")
def host_files(settings: Settings) -> tuple:
    """The runtime/ copy and the 0600 secrets, which downloads and builds need too.

    Returns the operations whose change the service restarts for.
    """
    snapshot.expect(files=[SECRETS_ENV, AUTH_HEADER, HF_ENV])
    runtime = snapshot.tree(name="runtime files on the host", src=str(PROJECT / "runtime"), dest=RUNTIME_DIR)
    token = secrets.hf_token(settings)
    hf_token_written(name="HF token in a 0600 file", token=SecretStr(token) if token else None,
                     removed=settings.hf_token is not None and not token)
    api_key = api_key_written(name="API key in 0600 files", api_key=settings.api_key,
                              key_file=secrets.api_key_path(settings))
    return runtime, api_key


@deploy("Serving")
def running(settings: Settings, also_restart_for: tuple = (), member: PairMember | None = None) -> None:
    """Unit and environment in place; the service runs exactly them; READY.

    Whether to (re)start is decided once, from what the running service started with
    (the revision its unit recorded at start) against what is on disk now — not from
    which files this run changed, so a host left in any state (crash loop, failed,
    stopped, restarting on its own) converges. A start that does not get READY is
    rolled back to the last settings that did.

    A pair member (``member``) runs its rank of the pair's engine; a headless one is READY
    when its head answers, and its restart rolls in its head's turn (rollout.py).
    """
    env_text = _render("serve.env.j2", env=settings.serve_env(member))
    unit_text = _render(
        "sparkfleet-serve.service.j2",
        hf_home=settings.hf_home,
        model_dir=settings.local_model_dir,
        container=CONTAINER,
        serve_env=SERVE_ENV,
        secrets_env=SECRETS_ENV,
        runtime_dir=RUNTIME_DIR,
        revision_file=REVISION_FILE,
        started_file=STARTED_FILE,
        image=local_image(settings),
        gpu_flag=container_runtime.unit_gpu_flag(settings),  # --gpus all, or CDI's --device
        rdma_devices=RDMA_DEVICES if member is not None else None,  # a pair member: NCCL's RoCE
    )
    snapshot.expect(texts=[f"{settings.hf_home}/.vllm_cache/{COMPILE_SIGNATURE}", STARTED_FILE,
                           f"{LAST_GOOD_DIR}/serving.rev"], units=[UNIT])
    env = snapshot.file(SERVE_ENV, env_text, name="serving settings (serve.env)")
    unit = snapshot.file(UNIT_PATH, unit_text, name=f"systemd unit {UNIT}")
    compile_cache = compile_cache_matches(name="torch.compile cache matches the profile",
                                          hf_home=settings.hf_home, signature=settings.compile_signature)
    feeds = (*[op for op in also_restart_for if op is not None], env, unit, compile_cache)

    # reenable, not only daemon-reload: a new [Install] section takes effect only so.
    server.shell(
        name="systemd reload for the new unit",
        commands=["systemctl daemon-reload", f"systemctl reenable {UNIT}"],
        _if=unit.did_change,
    )
    snapshot.service(UNIT, running=None, enabled=True, name=f"{UNIT} enabled")
    wanted = revision(env_text, unit_text, settings.compile_signature)
    # A host that serves now restarts in its turn of the rollout, which waits for READY
    # and gates it itself (rollout.py); rollout=all restarts every host at once.
    address = ready_address(settings, member)
    rolling = rollout.applies(settings, snapshot.unit(UNIT),
                              snapshot.fact(ServedModels, address=address, port=settings.port))
    started = serving(
        name=f"{UNIT} runs the settings on disk",
        revision=wanted,
        restart=any(op.will_change for op in feeds),
        rolling=settings if rolling else None,
        member=member,
    )
    ready(
        name="READY: the served model answers",  # a headless pair member: at its head
        address=address, port=settings.port, model=settings.served_model_name,
        timeout_s=settings.ready_timeout_s, restarting=started.will_change and not rolling,
        hint=_endpoint_hint(settings, member=member),
    )
    last_good_kept(name="these settings kept as the last good ones", revision=wanted, hf_home=settings.hf_home)


@deploy("Serving")
def stopped() -> None:
    """serving=false: the service stopped and disabled; image and weights stay."""
    snapshot.service(UNIT, running=False, enabled=False, name=f"{UNIT} stopped and disabled")
