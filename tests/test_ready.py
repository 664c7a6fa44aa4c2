"""The last good settings without a fleet: what ``keep_command`` keeps and ``restore_command``
puts back, as text and run by sh on files in a temporary directory (a recording
``systemctl`` on PATH); and the two operations that decide whether to wait for READY and
whether to keep the settings."""

from __future__ import annotations

import inspect
import os
import shlex
import subprocess
from pathlib import Path

import pytest
from pyinfra.api import FunctionCommand
from pyinfra.context import ctx_host
from support.fleetdata import fake_state

from sparkfleet import ready, snapshot
from sparkfleet.facts import ServedModels
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

CACHE = "/var/lib/sparkfleet/hf/.vllm_cache"
LG = LAST_GOOD_DIR


# --- the commands as text -----------------------------------------------------------------------


def test_keep_copies_into_a_new_directory_and_moves_it_in_place_last():
    assert ready.keep_command(CACHE).split(" && ") == [
        f"rm -rf {LG}.new", f"mkdir -p {LG}.new",
        f"cp {SERVE_ENV} {LG}.new/serve.env", f"cp {UNIT_PATH} {LG}.new/unit",
        f"cp {REVISION_FILE} {LG}.new/serving.rev", f"cp -a {RUNTIME_DIR} {LG}.new/runtime",
        f"install -m 0600 {SECRETS_ENV} {LG}.new/secrets.env", f"install -m 0600 {AUTH_HEADER} {LG}.new/api-auth.header",
        f"echo {CACHE} > {LG}.new/compile.path",
        f"{{ cp {CACHE}/{COMPILE_SIGNATURE} {LG}.new/compile-signature 2>/dev/null || true; }}",
        f"rm -rf {LG}", f"mv {LG}.new {LG}",
    ]
    assert f"echo '/data/my cache' > {LG}.new/compile.path" in ready.keep_command("/data/my cache")


def test_restore_without_restart_puts_the_files_back_only():
    lines = ready.restore_command(restart=False).splitlines()
    assert lines[0] == "set -e" and lines[-1] == f"cp {LG}/serving.rev {REVISION_FILE}"
    assert not [line for line in lines if "systemctl restart" in line or "reset-failed" in line]


def test_restore_ends_by_restarting_on_the_files_it_put_back():
    lines = ready.restore_command().splitlines()
    assert lines[:-2] == ready.restore_command(restart=False).splitlines()
    assert lines[-2:] == [f"systemctl reset-failed {UNIT} 2>/dev/null || true", f"systemctl restart {UNIT}"]


# --- the commands run -----------------------------------------------------------------------------


class Host:
    """The serving files of a host under ``root``, and a systemctl that records its calls."""

    def __init__(self, root: Path, monkeypatch):
        self.root = root
        self.paths = {name: root / name.lstrip("/")
                      for name in (SERVE_ENV, UNIT_PATH, REVISION_FILE, RUNTIME_DIR, LG, SECRETS_ENV, AUTH_HEADER)}
        for constant, path in [("SERVE_ENV", SERVE_ENV), ("UNIT_PATH", UNIT_PATH), ("REVISION_FILE", REVISION_FILE),
                               ("RUNTIME_DIR", RUNTIME_DIR), ("LAST_GOOD_DIR", LG), ("SECRETS_ENV", SECRETS_ENV),
                               ("AUTH_HEADER", AUTH_HEADER)]:
            monkeypatch.setattr(ready, constant, str(self.paths[path]))
        self.cache = root / "hf" / ".vllm_cache"
        bin_dir = root / "bin"
        bin_dir.mkdir()
        (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {root}/systemctl.log\n')
        (bin_dir / "systemctl").chmod(0o755)
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    def write(self, env: str, unit: str, rev: str, serve_py: str, signature: str, key: str = "k1",
              **extra: str) -> None:
        files = {SERVE_ENV: env, UNIT_PATH: unit, REVISION_FILE: rev, f"{RUNTIME_DIR}/serve.py": serve_py,
                 SECRETS_ENV: f"VLLM_API_KEY={key}\n", AUTH_HEADER: f"Authorization: Bearer {key}\n",
                 f"{CACHE}/{COMPILE_SIGNATURE}": signature, f"{CACHE}/torch_compile_cache/graph": signature, **extra}
        for name, text in files.items():
            path = self.root / name.lstrip("/") if not name.startswith(CACHE) else self.cache / name[len(CACHE) + 1:]
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)

    def sh(self, command: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sh", "-c", command], env=self.env, capture_output=True, text=True, timeout=30)

    def text(self, name: str) -> str:
        return (self.root / name.lstrip("/")).read_text()

    def systemctl(self) -> list[str]:
        log = self.root / "systemctl.log"
        return log.read_text().splitlines() if log.exists() else []


@pytest.fixture()
def spark(tmp_path, monkeypatch) -> Host:
    return Host(tmp_path, monkeypatch)


def test_what_was_kept_is_put_back_and_the_service_restarted_on_it(spark):
    spark.write("SF_PROFILE=base\n", "[Service]\nv1\n", "rev-1\n", "v1\n", "sig-1")
    assert spark.sh(ready.keep_command(str(spark.cache))).returncode == 0
    kept = spark.paths[LG]
    assert sorted(p.name for p in kept.iterdir()) == [
        "api-auth.header", "compile-signature", "compile.path", "runtime", "secrets.env", "serve.env", "serving.rev",
        "unit"]
    assert (kept / "secrets.env").stat().st_mode & 0o077 == 0  # the key stays root's alone
    assert (kept / "compile.path").read_text() == f"{spark.cache}\n" and (kept / "runtime" / "serve.py").exists()
    assert not Path(f"{kept}.new").exists()

    # A new start: every file changed, one more in the runtime copy, a new compile cache.
    spark.write("SF_PROFILE=dflash\n", "[Service]\nv2\n", "rev-2\n", "v2\n", "sig-2", key="k2",
                **{f"{RUNTIME_DIR}/added.py": "new\n"})
    done = spark.sh(ready.restore_command())
    assert done.returncode == 0, done.stderr
    assert (spark.text(SERVE_ENV), spark.text(UNIT_PATH), spark.text(REVISION_FILE)) == (
        "SF_PROFILE=base\n", "[Service]\nv1\n", "rev-1\n")
    assert sorted(p.name for p in spark.paths[RUNTIME_DIR].iterdir()) == ["serve.py"]
    assert spark.text(f"{RUNTIME_DIR}/serve.py") == "v1\n"
    # The key goes back with the settings: clients and checks use the one the engine runs.
    assert (spark.text(SECRETS_ENV), spark.text(AUTH_HEADER)) == ("VLLM_API_KEY=k1\n", "Authorization: Bearer k1\n")
    assert (spark.cache / COMPILE_SIGNATURE).read_text() == "sig-1"
    assert not (spark.cache / "torch_compile_cache").exists()  # compiled for the failed start's graph
    assert spark.systemctl() == ["daemon-reload", f"reenable {UNIT}", f"reset-failed {UNIT}", f"restart {UNIT}"]


def test_restoring_files_only_neither_restarts_nor_reloads_an_unchanged_unit(spark):
    spark.write("SF_PROFILE=base\n", "[Service]\nv1\n", "rev-1\n", "v1\n", "sig-1")
    assert spark.sh(ready.keep_command(str(spark.cache))).returncode == 0
    spark.write("SF_PROFILE=dflash\n", "[Service]\nv1\n", "rev-2\n", "v2\n", "sig-1")
    done = spark.sh(ready.restore_command(restart=False))
    assert done.returncode == 0, done.stderr
    assert (spark.text(SERVE_ENV), spark.text(REVISION_FILE), spark.text(f"{RUNTIME_DIR}/serve.py")) == (
        "SF_PROFILE=base\n", "rev-1\n", "v1\n")
    assert (spark.cache / "torch_compile_cache" / "graph").exists()  # its signature matches: kept
    assert spark.systemctl() == []


def test_a_keep_that_fails_half_way_leaves_the_last_good_copy_whole(spark):
    spark.write("SF_PROFILE=base\n", "[Service]\nv1\n", "rev-1\n", "v1\n", "sig-1")
    assert spark.sh(ready.keep_command(str(spark.cache))).returncode == 0
    spark.write("SF_PROFILE=dflash\n", "[Service]\nv2\n", "rev-2\n", "v2\n", "sig-2")
    spark.paths[REVISION_FILE].unlink()  # the copy of serving.rev fails
    assert spark.sh(ready.keep_command(str(spark.cache))).returncode != 0
    kept = spark.paths[LG]
    assert (kept / "serve.env").read_text() == "SF_PROFILE=base\n" and (kept / "serving.rev").read_text() == "rev-1\n"
    # Kept again, the copy is replaced, not nested in the old one.
    spark.write("SF_PROFILE=dflash\n", "[Service]\nv2\n", "rev-2\n", "v2\n", "sig-2")
    assert spark.sh(ready.keep_command(str(spark.cache))).returncode == 0
    assert (kept / "serving.rev").read_text() == "rev-2\n" and not (kept / "last-good.new").exists()
    assert sorted(p.name for p in kept.parent.iterdir() if p.name.startswith("last-good")) == ["last-good"]


def test_the_compile_signature_is_optional_for_keep_and_restore(spark):
    spark.write("A=1\n", "u\n", "rev-1\n", "v1\n", "sig-1")
    (spark.cache / COMPILE_SIGNATURE).unlink()  # a cache nothing was compiled into yet
    assert spark.sh(ready.keep_command(str(spark.cache))).returncode == 0
    assert not (spark.paths[LG] / "compile-signature").exists()
    done = spark.sh(ready.restore_command(restart=False))
    assert done.returncode == 0, done.stderr
    assert not (spark.cache / "torch_compile_cache").exists()  # no signature to vouch for it


def test_the_commands_quote_a_cache_path_with_spaces(spark):
    cache = spark.root / "my cache"
    cache.mkdir()
    (cache / COMPILE_SIGNATURE).write_text("sig-1")
    spark.write("A=1\n", "u\n", "rev-1\n", "v1\n", "sig-1")
    assert spark.sh(ready.keep_command(str(cache))).returncode == 0
    assert (spark.paths[LG] / "compile.path").read_text() == f"{cache}\n"
    assert shlex.quote(str(cache)) in ready.keep_command(str(cache))


# --- the operations -------------------------------------------------------------------------------


@pytest.fixture()
def current(monkeypatch):
    with fake_state(["@fake/spark-1"]) as state:
        spark = state.inventory.get_host("@fake/spark-1")
        spark.noops = []
        monkeypatch.setattr(spark, "noop", spark.noops.append)
        with ctx_host.use(spark):
            yield spark


def test_settings_already_kept_are_not_copied_again(current, monkeypatch):
    read = {f"{LG}/serving.rev": "rev-1"}
    monkeypatch.setattr(snapshot, "first_line", lambda path: read.get(path))
    assert list(ready.last_good_kept._inner(revision="rev-1", hf_home="/var/lib/sparkfleet/hf")) == []
    assert current.noops == ["the last good settings are these"]
    assert list(ready.last_good_kept._inner(revision="rev-2", hf_home="/var/lib/sparkfleet/hf")) == [
        ready.keep_command(CACHE)]
    read.clear()  # nothing kept yet
    assert len(list(ready.last_good_kept._inner(revision="rev-1", hf_home="/var/lib/sparkfleet/hf"))) == 1


@pytest.mark.parametrize("served,restarting,waits", [
    (["qwen"], False, False),  # serves already, nothing restarts: READY
    (["qwen"], True, True),  # the answer is the old engine's: wait for the new one
    ([], False, True),  # not serving (yet): wait
    (["another"], False, True),
], ids=["serving", "restarting", "not-serving", "another-model"])
def test_ready_waits_unless_the_model_answers_and_nothing_restarts(current, monkeypatch, served, restarting, waits):
    asked = []
    monkeypatch.setattr(snapshot, "fact", lambda cls, **kw: asked.append((cls, kw)) or served)
    commands = list(ready.ready._inner(address="127.0.0.1", port=8000, model="qwen", timeout_s=900,
                                       restarting=restarting, hint="the hint"))
    # Read with the host's snapshot; a restart makes any answer stale: nothing to ask.
    assert asked == ([] if restarting else [(ServedModels, {"address": "127.0.0.1", "port": 8000})])
    if not waits:
        assert commands == [] and current.noops == ["READY — the hint"]
        return
    [wait] = commands
    assert isinstance(wait, FunctionCommand) and current.noops == []
    assert inspect.getclosurevars(wait.function).nonlocals["function"] is ready.wait_ready
    assert wait.args == ("127.0.0.1", 8000, "qwen", 900, "the hint", restarting)
