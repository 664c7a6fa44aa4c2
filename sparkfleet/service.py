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
import shlex
from pathlib import Path

from pydantic import SecretStr
from pyinfra import host
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.api.util import get_template
from pyinfra.operations import server

from sparkfleet import container_runtime, credentials, ready, remote, rollout, snapshot
from sparkfleet.config import Settings
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
from sparkfleet.pairs import PairMember

PROJECT = Path(__file__).resolve().parents[1]
TEMPLATES = PROJECT / "templates"


def memory_needed(settings: Settings) -> float:
    """The share of the host's memory the service will claim when it starts (vLLM takes
    ``gpu_memory_utilization`` of the unified memory); 0 once our own server runs, as that
    memory is already ours."""
    running = snapshot.unit(UNIT).get("ActiveState") == "active"
    return 0.0 if running else settings.gpu_memory_utilization


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
    key = credentials.make_api_key(api_key, key_file)
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
        key = credentials.existing_api_key(api_key, key_file)
    except credentials.NotYetMade:  # made when the deploy executes, never while it plans
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


#: What the engine compiles into hf_home/.vllm_cache (runtime/serve_args.py's cache variables).
JIT_CACHES = ("torch_compile_cache", "triton", ".cache/flashinfer", "inductor", "nv")


@operation()
def compile_cache_matches(hf_home: str, signature: str):
    """
    Clear vLLM's torch.compile cache and the JIT kernels when what they were compiled for changed.

    + hf_home: the HF cache, holding vLLM's cache in ``.vllm_cache``
    + signature: what the cache depends on (``Settings.compile_signature``)

    A cache compiled for another graph crashes the next start (seen in the reference recipe).
    """
    cache = f"{hf_home}/.vllm_cache"
    signature_file = f"{cache}/{COMPILE_SIGNATURE}"
    if snapshot.first_line(signature_file) == signature:
        return
    # Every compiled artefact depends on the image (its torch, Triton, FlashInfer) and the graph.
    yield "rm -rf " + " ".join(shlex.quote(f"{cache}/{d}") for d in JIT_CACHES)
    yield f"mkdir -p {shlex.quote(cache)}"
    yield StringCommand("echo", shlex.quote(signature), ">", shlex.quote(signature_file))


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
        pair = member.pair if member is not None else None
        rollout.planned(rolling, pair)
        yield remote.callback(rollout.rolled, rolling, revision, pair)
        return
    yield StringCommand("echo", revision, ">", REVISION_FILE)
    # A crash loop's start limit must not block the deploy's own start.
    yield f"systemctl reset-failed {UNIT} 2>/dev/null; systemctl restart {UNIT}"


# --- the state ----------------------------------------------------------------------------


# What the rollout's decision reads while planning (running, below; stack.py's too).
snapshot.expect_first(texts=[STARTED_FILE, f"{LAST_GOOD_DIR}/serving.rev"], units=[UNIT])


@deploy("Host files")
def host_files(settings: Settings) -> tuple:
    """The runtime/ copy and the 0600 secrets, which downloads and builds need too.

    Returns the operations whose change the service restarts for.
    """
    snapshot.expect(files=[SECRETS_ENV, AUTH_HEADER, HF_ENV])
    runtime = snapshot.tree(name="runtime files on the host", src=str(PROJECT / "runtime"), dest=RUNTIME_DIR)
    token = credentials.hf_token(settings)
    hf_token_written(name="HF token in a 0600 file", token=SecretStr(token) if token else None,
                     removed=settings.hf_token is not None and not token)
    api_key = api_key_written(name="API key in 0600 files", api_key=settings.api_key,
                              key_file=credentials.api_key_path(settings))
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
    snapshot.expect(texts=[f"{settings.hf_home}/.vllm_cache/{COMPILE_SIGNATURE}"])
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
    address = ready.ready_address(settings, member)
    ready.declared(address, settings.port)  # before the first read of a feed's will_change below
    rolling = rollout.applies(settings, snapshot.unit(UNIT), snapshot.first_line(STARTED_FILE),
                              snapshot.first_line(f"{LAST_GOOD_DIR}/serving.rev"))
    started = serving(
        name=f"{UNIT} runs the settings on disk",
        revision=wanted,
        restart=any(op.will_change for op in feeds),
        rolling=settings if rolling else None,
        member=member,
    )
    ready.ready(
        name="READY: the served model answers",  # a headless pair member: at its head
        address=address, port=settings.port, model=settings.served_model_name,
        timeout_s=settings.ready_wait_s(pair=member is not None), restarting=started.will_change and not rolling,
        hint=ready.endpoint_hint(settings, member=member),
    )
    ready.last_good_kept(name="these settings kept as the last good ones", revision=wanted, hf_home=settings.hf_home)


@deploy("Serving")
def stopped() -> None:
    """serving=false: the service stopped and disabled; image and weights stay."""
    snapshot.service(UNIT, running=False, enabled=False, name=f"{UNIT} stopped and disabled")
