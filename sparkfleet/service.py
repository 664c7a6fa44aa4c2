"""The serving service: one systemd unit running the serving container, then READY.

Everything the container reads is a file the deploy owns: the unit, ``serve.env``
(profile settings), ``secrets.env`` (0600) and the ``runtime/`` copy. The unit is
reloaded only when it changed and the service restarted only when something that feeds
it changed — once per host, however many inputs changed.
"""

from __future__ import annotations

import hashlib
import ipaddress
import io
import json
import shlex
import time
from pathlib import Path

import gevent
from pyinfra import host, logger
from pyinfra.api import (
    FactBase,
    FileUploadCommand,
    FunctionCommand,
    StringCommand,
    operation,
)
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import Sha256File
from pyinfra.api.util import get_template
from pyinfra.operations import files, server, systemd

from sparkfleet import remote, rollout, secrets
from sparkfleet.config import Settings
from sparkfleet.hostpaths import (
    AUTH_HEADER,
    COMPILE_SIGNATURE,
    CONTAINER,
    HF_ENV,
    LAST_GOOD_DIR,
    REVISION_FILE,
    RUNTIME_DIR,
    SECRETS_ENV,
    SERVE_ENV,
    STARTED_FILE,
    UNIT,
    UNIT_PATH,
)
from sparkfleet.mirror import image_reference

PROJECT = Path(__file__).resolve().parents[1]
TEMPLATES = PROJECT / "templates"
READY_PROMPT = "What is the capital of France? Answer in one word."


def memory_needed(settings: Settings) -> float:
    """The share of the host's memory the service will claim when it starts (vLLM takes
    ``gpu_memory_utilization`` of the unified memory); 0 once our own server runs, as that
    memory is already ours."""
    return 0.0 if host.get_fact(UnitState).get("ActiveState") == "active" else settings.gpu_memory_utilization


def port_problem(settings: Settings) -> str | None:
    """Why the service could not bind its port here, or None: the port is free or held
    by our own serving container."""
    holders = host.get_fact(PortHolders, port=settings.port)
    if not holders:
        return None
    return (f"port {settings.port} is held by {', '.join(holders)}: stop that process, or choose "
            "another port with --data port=N")


def local_address(settings: Settings) -> str:
    """Where a client on the host itself reaches the API, ready for a URL."""
    address = ipaddress.ip_address(settings.bind_address)
    if address.is_unspecified or address.is_loopback:
        return "127.0.0.1" if address.version == 4 or address.is_unspecified else "[::1]"
    return f"[{address}]" if address.version == 6 else str(address)


# --- facts --------------------------------------------------------------------------


class UnitState(FactBase["dict[str, str]"]):
    """ActiveState, SubState, start time and restart count of the serving unit, and
    ``Started``: the revision its running service started with (empty when stopped)."""

    @staticmethod
    def default():
        return {}

    def command(self) -> str:
        return (
            f"systemctl show {UNIT} -p ActiveState -p SubState -p ExecMainStartTimestampMonotonic "
            f"-p NRestarts -p UnitFileState; echo Started=$(cat {STARTED_FILE} 2>/dev/null)"
        )

    def process(self, output):
        return dict(line.split("=", 1) for line in output if "=" in line)


class PortHolders(FactBase["list[str]"]):
    """Processes listening on ``port`` other than our serving container's, as "name (pid N)"."""

    requires_command = "ss"

    @staticmethod
    def default():
        return []

    def command(self, port: int) -> str:
        # Our container's processes carry its id in their cgroup path (either cgroup driver).
        return (
            f"cid=$(docker inspect -f '{{{{.Id}}}}' {CONTAINER} 2>/dev/null); "
            f"for p in $(ss -Hltnp 'sport = :{int(port)}' | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do "
            '[ -n "$cid" ] && grep -q "$cid" /proc/$p/cgroup 2>/dev/null && continue; '
            'echo "$(cat /proc/$p/comm 2>/dev/null) (pid $p)"; done'
        )

    def process(self, output):
        return [line.strip() for line in output if line.strip()]


class ServedAnswer(FactBase["str | None"]):
    """The served model's answer to a one-token request, or None if it does not answer."""

    def command(self, address: str, port: int, model: str) -> str:
        body = json.dumps({"model": model, "prompt": READY_PROMPT, "max_tokens": 1, "temperature": 0})
        # The key travels in a 0600 header file, never on the command line.
        return (
            f"curl -sS -m 10 -H @{AUTH_HEADER} -H 'Content-Type: application/json' "
            f"-d {shlex.quote(body)} http://{address}:{port}/v1/completions 2>/dev/null || true"
        )

    def process(self, output):
        try:
            return json.loads("\n".join(output))["choices"][0]["text"]
        except (ValueError, KeyError, IndexError, TypeError):
            return None


class ServedModels(FactBase["list[str]"]):
    """The model names the API lists (empty when it does not answer)."""

    @staticmethod
    def default():
        return []

    def command(self, address: str, port: int) -> str:
        return f"curl -sS -m 5 -H @{AUTH_HEADER} http://{address}:{port}/v1/models 2>/dev/null || true"

    def process(self, output):
        try:
            return [model["id"] for model in json.loads("\n".join(output))["data"]]
        except (ValueError, KeyError, TypeError):
            return []


class FileText(FactBase["str | None"]):
    """A small file's text, or None when absent."""

    def command(self, path: str) -> str:
        return f"cat {shlex.quote(path)} 2>/dev/null || echo __absent__"

    def process(self, output):
        text = "\n".join(output)
        return None if text == "__absent__" else text


# --- operations -------------------------------------------------------------------------


@operation()
def api_key_written(settings: Settings):
    """
    Write the API key into the root-only files the serving container and checks read.

    + settings: validated settings (``api_key``)

    The content never appears in argv, output or diffs: only its hash is compared.
    """
    api_key = secrets.api_key(settings)
    yield from _private_file(SECRETS_ENV, f"VLLM_API_KEY={api_key}\n" if api_key else "")
    yield from _private_file(AUTH_HEADER, f"Authorization: Bearer {api_key}\n" if api_key else "")


@operation()
def hf_token_written(settings: Settings):
    """
    Write the HF token into the root-only file that downloads and builds read.

    + settings: validated settings (``hf_token``; else the controller's HF_TOKEN)

    Serving never reads it (it starts offline), so it is no restart input; and a controller
    without a token leaves the hosts' token alone (``--data hf_token=`` removes it).
    """
    token = secrets.hf_token(settings)
    if token is None and settings.hf_token is None:
        if host.get_fact(Sha256File, path=HF_ENV) is None:
            yield from _private_file(HF_ENV, "")
        return
    yield from _private_file(HF_ENV, f"HF_TOKEN={token}\n" if token else "")


def _private_file(path: str, content: str):
    wanted = hashlib.sha256(content.encode()).hexdigest()
    if host.get_fact(Sha256File, path=path) == wanted:
        return
    directory = path.rsplit("/", 1)[0]
    yield f"install -d -m 0755 {directory} && install -m 0600 /dev/null {path}"
    yield FileUploadCommand(io.BytesIO(content.encode()), path)
    yield f"chmod 0600 {path}"


@operation()
def compile_cache_matches(settings: Settings):
    """
    Clear vLLM's torch.compile cache when the profile or speculative depth changed.

    + settings: validated settings

    A cache compiled for another graph crashes the next start (seen in the seeds).
    """
    cache = f"{settings.hf_home}/.vllm_cache"
    signature_file = f"{cache}/{COMPILE_SIGNATURE}"
    if host.get_fact(FileText, path=signature_file) == settings.compile_signature:
        return
    yield f"rm -rf {shlex.quote(cache + '/torch_compile_cache')}"
    yield f"mkdir -p {shlex.quote(cache)}"
    yield StringCommand("echo", shlex.quote(settings.compile_signature), ">", shlex.quote(signature_file))


def _wait_ready(state, host, settings: Settings, restarting: bool) -> bool:  # pyinfra passes state, host
    """Wait for READY; when a (re)start of ours does not get there, roll back."""
    failure = _await_ready(host, settings)
    if failure is None:
        return True
    journal = _journal_tail(host)
    if not restarting:  # not our change: report, touch nothing
        raise OperationError(f"service: {failure}. Last log lines:\n{journal}")
    last_good = remote.run(host, f"cat {LAST_GOOD_DIR}/serving.rev").stdout
    if not last_good or last_good == remote.run(host, f"cat {REVISION_FILE}").stdout:
        remote.run(host, f"systemctl stop {UNIT}")
        raise OperationError(
            f"service: {failure}; nothing else got READY on this host before, so {UNIT} is stopped "
            f"(not left crash-looping) — fix the settings and deploy again. Last log lines:\n{journal}"
        )
    change = _change_from_last_good(host)
    host.log(f"{failure}: rolling back to the last good settings ({change})", logger.warning)
    restored = remote.run(host, _restore_last_good(), timeout=300)
    again = _await_ready(host, settings) if restored.ok else "could not restore: " + " ".join(restored.stderr)
    outcome = (
        "rolled back: the last good settings serve again" if again is None
        else f"the rollback did not get READY either ({again})"
    )
    raise OperationError(
        f"service: the new settings did not get READY ({failure}); {outcome}. Changed: {change} — "
        f"fix that and deploy again. Last log lines of the failed start:\n{journal}"
    )


def _await_ready(host, settings: Settings) -> str | None:
    """Poll until the served model answers a real request: None, or why it did not."""
    started = time.monotonic()
    last_report = started
    address = local_address(settings)
    restarts_before = host.get_fact(UnitState).get("NRestarts", "0")
    while True:
        answer = host.get_fact(ServedAnswer, address=address, port=settings.port, model=settings.served_model_name)
        elapsed = time.monotonic() - started
        if answer is not None:
            host.log(f"READY in {elapsed:.0f} s — {_endpoint_hint(host, settings)}", logger.info)
            return None
        unit = host.get_fact(UnitState)
        # A restart while we wait means the engine died: its log says why, waiting won't.
        if unit.get("ActiveState") in ("failed", "inactive"):
            return f"the engine exited ({UNIT} {unit.get('ActiveState')})"
        if unit.get("NRestarts", "0") != restarts_before:
            return f"the engine exited and systemd restarted it ({UNIT} {unit.get('SubState')})"
        if elapsed > settings.ready_timeout_s:
            return f"not READY after {settings.ready_timeout_s} s (ready_timeout_s; raise it for slow first starts)"
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


def _endpoint_hint(target_host, settings: Settings) -> str:
    mode = settings.api_key.get_secret_value()
    key = (
        f"API key in {settings.api_key_file}" if mode == "auto"
        else "no API key (api_key=none)" if mode == "none" else "API key as configured"
    )
    address = target_host.data.get("ssh_hostname") or target_host.name
    return f"http://{address}:{settings.port}/v1 serves `{settings.served_model_name}` ({settings.profile}); {key}"


def _journal_tail(target_host, lines: int = 25) -> str:
    tail = remote.run(target_host, f"journalctl -u {UNIT} -n {lines} --no-pager -o cat 2>&1 | tail -n {lines}")
    return "    " + "\n    ".join(tail.stdout or ["(journal is empty)"])


@operation(is_idempotent=False)
def ready(settings: Settings, restarting: bool):
    """
    Wait until the served model answers a real request (not only /health).

    + settings: validated settings (``port``, ``served_model_name``, ``ready_timeout_s``)
    + restarting: whether this run (re)starts the service, so a current answer is stale
    """
    # Cheap while planning (and under --dry): the API lists the model. After a (re)start
    # the wait below asks for a real completion.
    served = host.get_fact(ServedModels, address=local_address(settings), port=settings.port)
    if settings.served_model_name in served and not restarting:
        host.noop(f"READY — {_endpoint_hint(host, settings)}")
        return
    yield FunctionCommand(_wait_ready, (settings, restarting), {})


def _render(template: str, **context) -> str:
    """A file of templates/, rendered as pyinfra's files.template renders it."""
    return get_template(str(TEMPLATES / template)).render(context)


def _tree_hash(root: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc":
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def revision(settings: Settings, env_text: str, unit_text: str) -> str:
    """One hash of everything the serving container runs: serve.env, the unit, the runtime
    copy, the API key (hashed) and the compile signature."""
    key = hashlib.sha256((secrets.api_key(settings) or "").encode()).hexdigest()
    parts = (env_text, unit_text, _tree_hash(PROJECT / "runtime"), key, settings.compile_signature)
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


@operation()
def serving(revision: str, restart: bool, rolling: Settings | None = None):
    """
    The service runs the settings on disk: (re)started unless it already runs exactly them.

    + revision: hash of everything the service runs (``revision()``)
    + restart: an input the hash does not cover changed (a rebuilt checkpoint)
    + rolling: this serving host's settings when its restart rolls (rollout.py): it waits
      for its batch, is drained, restarted, gated and put back

    One decision from the unit's own record of what it started with, so a host in any
    state (crash loop, failed, stopped, restarting on its own) converges in one run.
    """
    unit = host.get_fact(UnitState)
    if not restart and unit.get("ActiveState") == "active" and unit.get("Started") == revision:
        host.noop(f"{UNIT} runs these settings")
        return
    if rolling is not None:
        rollout.planned(rolling)
        yield FunctionCommand(rollout.rolled, (rolling, revision), {})
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
    if host.get_fact(FileText, path=f"{LAST_GOOD_DIR}/serving.rev") == revision:
        host.noop("the last good settings are these")
        return
    yield _snapshot_last_good(f"{hf_home}/.vllm_cache")


# --- the state ----------------------------------------------------------------------------


def host_files(settings: Settings) -> tuple:
    """The runtime/ copy and the 0600 secrets, which downloads and builds need too.

    Returns the operations whose change the service restarts for.
    """
    runtime = files.sync(
        name="runtime files on the host",
        src=str(PROJECT / "runtime"),
        dest=RUNTIME_DIR,
        delete=True,
        exclude=["*.pyc"],
        exclude_dir=["__pycache__", "*/__pycache__"],
        # Fixed modes: the controller's umask must not make a converged host look changed.
        mode="644",
        dir_mode="755",
    )
    hf_token_written(name="HF token in a 0600 file", settings=settings)
    api_key = api_key_written(name="API key in 0600 files", settings=settings)
    return runtime, api_key


def running(settings: Settings, also_restart_for: tuple = ()) -> None:
    """Unit and environment in place; the service runs exactly them; READY.

    Whether to (re)start is decided once, from what the running service started with
    (the revision its unit recorded at start) against what is on disk now — not from
    which files this run changed, so a host left in any state (crash loop, failed,
    stopped, restarting on its own) converges. A start that does not get READY is
    rolled back to the last settings that did.
    """
    env_text = _render("serve.env.j2", env=settings.serve_env())
    unit_text = _render(
        "sparkfleet-serve.service.j2",
        settings=settings,
        container=CONTAINER,
        serve_env=SERVE_ENV,
        secrets_env=SECRETS_ENV,
        runtime_dir=RUNTIME_DIR,
        revision_file=REVISION_FILE,
        started_file=STARTED_FILE,
        image=image_reference(settings),
    )
    env = files.put(name="serving settings (serve.env)", src=io.StringIO(env_text), dest=SERVE_ENV, mode="644")
    unit = files.put(name=f"systemd unit {UNIT}", src=io.StringIO(unit_text), dest=UNIT_PATH, mode="644")
    compile_cache = compile_cache_matches(name="torch.compile cache matches the profile", settings=settings)

    # reenable, not only daemon-reload: a new [Install] section takes effect only so.
    server.shell(
        name="systemd reload for the new unit",
        commands=["systemctl daemon-reload", f"systemctl reenable {UNIT}"],
        _if=unit.did_change,
    )
    systemd.service(name=f"{UNIT} enabled", service=UNIT, running=None, enabled=True)
    wanted = revision(settings, env_text, unit_text)
    # A host that serves now restarts in its turn of the rollout, which waits for READY
    # and gates it itself (rollout.py); rollout=all restarts every host at once.
    rolling = rollout.applies(settings, host.get_fact(UnitState),
                              host.get_fact(ServedModels, address=local_address(settings), port=settings.port))
    started = serving(
        name=f"{UNIT} runs the settings on disk",
        revision=wanted,
        restart=any(op.will_change for op in (*also_restart_for, env, unit, compile_cache)),
        rolling=settings if rolling else None,
    )
    ready(name="READY: the served model answers", settings=settings,
          restarting=started.will_change and not rolling)
    last_good_kept(name="these settings kept as the last good ones", revision=wanted, hf_home=settings.hf_home)


def stopped() -> None:
    """serving=false: the service stopped and disabled; image and weights stay."""
    systemd.service(name=f"{UNIT} stopped and disabled", service=UNIT, running=False, enabled=False)
