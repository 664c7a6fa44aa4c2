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
from pyinfra.operations import files, systemd

from sparkfleet import container_runtime, remote, secrets
from sparkfleet.config import Settings
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
READY_PROMPT = "What is the capital of France? Answer in one word."


def memory_needed(settings: Settings) -> float:
    """The share of the host's memory the service will claim when it starts (vLLM takes
    ``gpu_memory_utilization`` of the unified memory); 0 once our own server runs, as that
    memory is already ours."""
    return 0.0 if host.get_fact(UnitState).get("ActiveState") == "active" else settings.gpu_memory_utilization


def local_address(settings: Settings) -> str:
    """Where a client on the host itself reaches the API, ready for a URL."""
    address = ipaddress.ip_address(settings.bind_address)
    if address.is_unspecified or address.is_loopback:
        return "127.0.0.1" if address.version == 4 or address.is_unspecified else "[::1]"
    return f"[{address}]" if address.version == 6 else str(address)


# --- facts --------------------------------------------------------------------------


class UnitState(FactBase["dict[str, str]"]):
    """ActiveState, start time and restart count of the serving unit."""

    @staticmethod
    def default():
        return {}

    def command(self) -> str:
        return f"systemctl show {UNIT} -p ActiveState -p ExecMainStartTimestampMonotonic -p NRestarts -p UnitFileState"

    def process(self, output):
        return dict(line.split("=", 1) for line in output if "=" in line)


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


def _wait_ready(state, host, settings: Settings) -> bool:  # pyinfra passes state and host by these names
    """Poll until the served model answers a real request; fail early if the engine dies."""
    started = time.monotonic()
    last_report = started
    address = local_address(settings)
    restarts_before = host.get_fact(UnitState).get("NRestarts", "0")
    while True:
        answer = host.get_fact(ServedAnswer, address=address, port=settings.port, model=settings.served_model_name)
        elapsed = time.monotonic() - started
        if answer is not None:
            host.log(f"READY in {elapsed:.0f} s — {_endpoint_hint(host, settings)}", logger.info)
            return True
        unit = host.get_fact(UnitState)
        # A restart while we wait means the engine died: its log says why, waiting won't.
        if unit.get("ActiveState") in ("failed", "inactive") or unit.get("NRestarts", "0") != restarts_before:
            raise OperationError(
                f"{UNIT} died while starting (state {unit.get('ActiveState')}); last log lines:\n"
                + _journal_tail(host)
            )
        if elapsed > settings.ready_timeout_s:
            raise OperationError(
                f"not READY after {settings.ready_timeout_s} s (raise ready_timeout_s for slow first starts); "
                "last log lines:\n" + _journal_tail(host)
            )
        if time.monotonic() - last_report >= 15:
            last_report = time.monotonic()
            host.log(f"waiting for READY: {elapsed:.0f} s, unit {unit.get('ActiveState')}", logger.info)
        gevent.sleep(2)


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
    yield FunctionCommand(_wait_ready, (settings,), {})


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
    """Unit and environment in place; restarted once if anything that feeds it changed; READY."""
    was_active = host.get_fact(UnitState).get("ActiveState") == "active"
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
        settings=settings,
        container=CONTAINER,
        serve_env=SERVE_ENV,
        secrets_env=SECRETS_ENV,
        runtime_dir=RUNTIME_DIR,
        image=image_reference(settings),
        gpu_flag=container_runtime.unit_gpu_flag(settings),  # --gpus all, or CDI's --device
    )
    compile_cache = compile_cache_matches(name="torch.compile cache matches the profile", settings=settings)
    feeds = (*also_restart_for, env, unit, compile_cache)

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
        settings=settings,
        restarting=any(op.will_change for op in feeds),
    )


def stopped() -> None:
    """serving=false: the service stopped and disabled; image and weights stay."""
    systemd.service(name=f"{UNIT} stopped and disabled", service=UNIT, running=False, enabled=False)
