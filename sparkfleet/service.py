"""The serving service: one systemd unit running the serving container, then READY.

Everything the container reads is a file the deploy owns: the unit, ``serve.env``
(profile settings), ``secrets.env`` (0600) and the ``runtime/`` copy. The unit is
reloaded only when it changed and the service restarted only when something that feeds
it changed — once per host, however many inputs changed.
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
from pyinfra.api import FileUploadCommand, FunctionCommand, StringCommand, deploy, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.files import FileContents, Sha256File
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import files, systemd

from sparkfleet import remote, secrets
from sparkfleet.bench.onhost.workloads import SMOKE_PROMPT as READY_PROMPT  # READY asks what smoke asks
from sparkfleet.config import Settings
from sparkfleet.facts import ServedAnswer, ServedModels, UnitState
from sparkfleet.hostpaths import (
    AUTH_HEADER,
    COMPILE_SIGNATURE,
    CONTAINER,
    HF_ENV,
    RUNTIME_DIR,
    SECRETS_ENV,
    SERVE_ENV,
    UNIT,
    UNIT_PATH,
)
from sparkfleet.mirror import image_reference

PROJECT = Path(__file__).resolve().parents[1]
TEMPLATES = PROJECT / "templates"


def memory_needed(settings: Settings) -> float:
    """The share of the host's memory the service will claim when it starts (vLLM takes
    ``gpu_memory_utilization`` of the unified memory); 0 once our own server runs, as that
    memory is already ours."""
    running = host.get_fact(SystemdStatus, services=UNIT).get(UNIT, False)
    return 0.0 if running else settings.gpu_memory_utilization


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
    if host.get_fact(Sha256File, path=path) == wanted:
        return
    directory = path.rsplit("/", 1)[0]
    yield f"install -d -m 0755 {directory} && install -m 0600 /dev/null {path}"
    yield FileUploadCommand(io.BytesIO(content.encode()), path)
    yield f"chmod 0600 {path}"


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
        yield FunctionCommand(_write_new_api_key, (api_key, key_file), {})
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
        if host.get_fact(Sha256File, path=HF_ENV) is None:
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
    if (host.get_fact(FileContents, path=signature_file) or [None])[0] == signature:
        return
    yield f"rm -rf {shlex.quote(cache + '/torch_compile_cache')}"
    yield f"mkdir -p {shlex.quote(cache)}"
    yield StringCommand("echo", shlex.quote(signature), ">", shlex.quote(signature_file))


# --- READY --------------------------------------------------------------------------------


def _wait_ready(state, host, address: str, port: int, model: str, timeout_s: int, hint: str) -> bool:  # state, host: pyinfra's
    """Poll until the served model answers a real request; fail early if the engine dies."""
    started = time.monotonic()
    last_report = started
    restarts_before = host.get_fact(UnitState, unit=UNIT).get("NRestarts", "0")
    while True:
        answer = host.get_fact(ServedAnswer, address=address, port=port, model=model, prompt=READY_PROMPT)
        elapsed = time.monotonic() - started
        if answer is not None:
            host.log(f"READY in {elapsed:.0f} s — {hint}", logger.info)
            return True
        unit = host.get_fact(UnitState, unit=UNIT)
        # A restart while we wait means the engine died: its log says why, waiting won't.
        if unit.get("ActiveState") in ("failed", "inactive") or unit.get("NRestarts", "0") != restarts_before:
            raise OperationError(
                f"{UNIT} died while starting (state {unit.get('ActiveState')}); last log lines:\n"
                + _journal_tail(host)
            )
        if elapsed > timeout_s:
            raise OperationError(
                f"not READY after {timeout_s} s (raise ready_timeout_s for slow first starts); "
                "last log lines:\n" + _journal_tail(host)
            )
        if time.monotonic() - last_report >= 15:
            last_report = time.monotonic()
            host.log(f"waiting for READY: {elapsed:.0f} s, unit {unit.get('ActiveState')}", logger.info)
        gevent.sleep(2)


def _endpoint_hint(settings: Settings) -> str:
    mode = settings.api_key.get_secret_value()
    key = (
        f"API key in {settings.api_key_file}" if mode == "auto"
        else "no API key (api_key=none)" if mode == "none" else "API key as configured"
    )
    address = host.data.get("ssh_hostname") or host.name
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
    yield FunctionCommand(_wait_ready, (address, port, model, timeout_s, hint), {})


# --- the state ----------------------------------------------------------------------------


@deploy("Host files")
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
    token = secrets.hf_token(settings)
    hf_token_written(name="HF token in a 0600 file", token=SecretStr(token) if token else None,
                     removed=settings.hf_token is not None and not token)
    api_key = api_key_written(name="API key in 0600 files", api_key=settings.api_key,
                              key_file=secrets.api_key_path(settings))
    return runtime, api_key


@deploy("Serving")
def running(settings: Settings, also_restart_for: tuple = ()) -> None:
    """Unit and environment in place; restarted once if anything that feeds it changed; READY."""
    was_active = host.get_fact(UnitState, unit=UNIT).get("ActiveState") == "active"
    env = files.template(
        name="serving settings (serve.env)",
        src=str(TEMPLATES / "serve.env.j2"),
        dest=SERVE_ENV,
        mode="644",
        env=settings.serve_env(),
    )
    unit = files.template(
        name=f"systemd unit {UNIT}",
        src=str(TEMPLATES / "sparkfleet-serve.service.j2"),
        dest=UNIT_PATH,
        mode="644",
        hf_home=settings.hf_home,
        model_dir=settings.local_model_dir,
        container=CONTAINER,
        serve_env=SERVE_ENV,
        secrets_env=SECRETS_ENV,
        runtime_dir=RUNTIME_DIR,
        image=image_reference(settings),
    )
    compile_cache = compile_cache_matches(name="torch.compile cache matches the profile",
                                          hf_home=settings.hf_home, signature=settings.compile_signature)
    feeds = (*[op for op in also_restart_for if op is not None], env, unit, compile_cache)

    systemd.daemon_reload(name="systemd reload for the new unit", _if=unit.did_change)
    systemd.service(name=f"{UNIT} enabled and running", service=UNIT, running=True, enabled=True)
    systemd.service(
        name=f"{UNIT} restarted for its new settings",
        service=UNIT,
        restarted=True,
        _if=lambda: was_active and any(op.did_change() for op in feeds),
    )
    ready(
        name="READY: the served model answers",
        address=local_address(settings.bind_address), port=settings.port, model=settings.served_model_name,
        timeout_s=settings.ready_timeout_s, restarting=any(op.will_change for op in feeds),
        hint=_endpoint_hint(settings),
    )


@deploy("Serving")
def stopped() -> None:
    """serving=false: the service stopped and disabled; image and weights stay."""
    systemd.service(name=f"{UNIT} stopped and disabled", service=UNIT, running=False, enabled=False)
