"""Post-deploy checks as pyinfra operations: run on every host, collect on the controller.

    from sparkfleet.bench.deploy import run_checks
    run_checks(["smoke", "decode"])          # or run_checks() to read data `checks`

Per host: upload the on-host bench program (``onhost/``) and, for the agent bench, a
snapshot of the controller's Hermes ``state.db``; run the program against the host's
own server, inside the serving image (``docker run --network host`` of the image the
``sparkfleet-serve`` container runs, so the host needs nothing but docker); fetch its
result into ``<results_dir>/<run-id>/<host>.json``. Hosts run in parallel, as pyinfra
runs every operation. The program's progress lines stream live, prefixed by host.

A host whose checks cannot run (server down, container missing, SSH gone, failed earlier
in the deploy) still gets a result file, ``status: failed`` with the reason, and fails
in pyinfra's summary; the others report. When the collect operation has ended on every
host, the fleet report (``sparkfleet.bench.report``) is written next to the results and printed.
"""

from __future__ import annotations

import atexit
import io
import json
import os
import shlex
import shutil
import sqlite3
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pyinfra import host, state
from pyinfra.api import StringCommand, deploy
from pyinfra.api.exceptions import OperationError
from pyinfra.api.state import BaseStateCallback
from pyinfra.operations import files, python

from sparkfleet import remote as host_commands  # "remote" names the result path below
from sparkfleet.fleet import all_pairs, fleet_settings
from sparkfleet.hostpaths import CONTAINER, SECRETS_ENV

from .onhost.schema import ProgramSettings, failed_result, now_iso
from .results import result_path, run_dir, write_json
from .settings import BenchSettings, bench_settings, parse_check_names, run_id_for

ONHOST_SRC = Path(__file__).resolve().parent / "onhost"
# The package name the program has on the host (its directory name there).
REMOTE_PACKAGE = "sparkfleet_onhost"
CONTAINER_SECRETS = "/run/sparkfleet/secrets.env"
CONTAINER_CODE_ROOT = "/opt/sparkfleet-bench"
COLLECT_OP_NAME = "sparkfleet checks: run on the host and collect the result"
# flock's exit status when another bench holds the host's lock (sysexits EX_TEMPFAIL).
LOCKED_EXIT = 75
_LOCK_MESSAGE = (
    f"rc=$?; [ $rc -eq {LOCKED_EXIT} ] && echo 'another sparkfleet bench is running on this host' >&2; exit $rc"
)


# --- the command that runs on the host -------------------------------------------------------


# Seconds between the program's "still running" lines.
HEARTBEAT_S = 15.0


def program_settings(s: BenchSettings, names: Sequence[str], run_id: str, host_name: str,
                     remote_result: str, remote_state_db: str | None, secrets_file: str) -> ProgramSettings:
    """The on-host program's one settings document, from the validated host settings."""
    return ProgramSettings(
        base_url=s.base_url, model=s.served_model_name, checks=list(names), out=remote_result, run_id=run_id,
        host=host_name, secrets_file=secrets_file, runs=s.bench_runs, warmup=s.bench_warmup,
        max_tokens=s.bench_max_tokens, prompt=s.bench_prompt, state_db=remote_state_db,
        agent_sessions=s.agent_sessions, agent_max_context_tokens=s.agent_max_context_tokens,
        agent_max_tokens=s.agent_max_tokens, timeout_s=float(s.bench_timeout_s), heartbeat_s=HEARTBEAT_S,
        quiet=False,
    )


def remote_paths(s: BenchSettings, run_id: str) -> dict[str, str]:
    return {
        "code_root": f"{s.bench_dir}/code",
        "code": f"{s.bench_dir}/code/{REMOTE_PACKAGE}",
        "state_db": f"{s.bench_dir}/state.db",
        "result": f"{s.bench_dir}/results/{run_id}.json",
        "lock": f"{s.bench_dir}/.lock",
    }


def bench_command(s: BenchSettings, names: Sequence[str], run_id: str, host_name: str) -> str:
    """The shell script that runs the bench on the host (every dynamic value quoted).

    Exit status: the program's (0 ok, 1 a check failed: the result file says why), 3 no
    serving container, 75 another bench holds the lock, anything else: see stderr.
    """
    p = remote_paths(s, run_id)
    q = shlex.quote
    state_db = p["state_db"] if "agent" in names else None
    lines = [
        f"mkdir -p {q(s.bench_dir + '/results')}",
        f"rm -f {q(p['result'])}",
    ]
    if s.bench_runner == "host":
        doc = program_settings(s, names, run_id, host_name, p["result"], state_db, SECRETS_ENV).to_json()
        lines.append(
            f"cd {q(p['code_root'])} && PYTHONPATH={q(p['code_root'])} PYTHONUNBUFFERED=1 "
            f"flock -n -E {LOCKED_EXIT} {q(p['lock'])} python3 -m {REMOTE_PACKAGE} --settings {q(doc)}"
        )
        lines.append(_LOCK_MESSAGE)
        return "\n".join(lines)
    doc = program_settings(s, names, run_id, host_name, p["result"], state_db, CONTAINER_SECRETS).to_json()
    container = q(CONTAINER)
    lines += [
        # The image the serving container runs, by ID: it has python3 and prometheus_client,
        # and a mutable tag cannot swap it under us.
        f"IMAGE=$(docker inspect --format '{{{{.Image}}}}' {container} 2>/dev/null) || "
        f"{{ echo 'no {CONTAINER} container on this host: deploy first (pyinfra INVENTORY deploy.py)' >&2; exit 3; }}",
        f"[ \"$(docker inspect --format '{{{{.State.Running}}}}' {container})\" = true ] || "
        f"{{ echo '{CONTAINER} is not running: see systemctl status {CONTAINER}' >&2; exit 3; }}",
        # The key reaches the bench as a read-only file, never through argv.
        f"if [ -f {q(SECRETS_ENV)} ]; then set -- -v {q(SECRETS_ENV + ':' + CONTAINER_SECRETS + ':ro')}; else set --; fi",
        # root in the container: it reads the 0600 secrets file, whatever USER the image sets
        f"flock -n -E {LOCKED_EXIT} {q(p['lock'])} docker run --rm --network host --entrypoint python3 --user 0:0"
        f" -e PYTHONPATH={CONTAINER_CODE_ROOT} -e PYTHONUNBUFFERED=1"
        f" -v {q(p['code'] + ':' + CONTAINER_CODE_ROOT + '/' + REMOTE_PACKAGE + ':ro')}"
        f" -v {q(s.bench_dir + ':' + s.bench_dir)}"
        f" \"$@\" \"$IMAGE\" -m {REMOTE_PACKAGE} --settings {q(doc)}",
        _LOCK_MESSAGE,
    ]
    return "\n".join(lines)


def failure_reason(stdout: list[str], stderr: list[str]) -> str:
    """The last meaningful stderr lines of a run that left no result file."""
    lines = [ln.strip() for ln in stderr if ln.strip()] or [ln.strip() for ln in stdout if ln.strip()]
    tail = " | ".join(lines[-3:]) if lines else "no output"
    return f"bench did not run: {tail}"


# --- the state.db snapshot (controller side) ---------------------------------------------------

_SNAPSHOTS: dict[str, str] = {}


def snapshot_state_db(path: str) -> str:
    """A consistent copy of a live Hermes state.db (WAL mode), made once per run.

    Copying the file alone would miss what is still in ``state.db-wal``; SQLite's backup
    API reads through it. The copy sits in a private temp dir, removed at exit.
    """
    src = os.path.abspath(os.path.expanduser(path))
    if src in _SNAPSHOTS:
        return _SNAPSHOTS[src]
    if not os.path.isfile(src):
        raise ValueError(
            f"agent_state_db={path!r}: no such file on the controller; "
            "point it at a Hermes state.db (e.g. ~/.hermes/state.db)"
        )
    tmpdir = tempfile.mkdtemp(prefix="sparkfleet-statedb-")
    atexit.register(shutil.rmtree, tmpdir, True)
    dest = os.path.join(tmpdir, "state.db")
    source = sqlite3.connect(f"file:{src}?mode=ro", uri=True)
    try:
        target = sqlite3.connect(dest)
        source.backup(target)
        target.execute("PRAGMA journal_mode=DELETE")  # a single self-contained file
        target.close()
    finally:
        source.close()
    os.chmod(dest, 0o600)
    _SNAPSHOTS[src] = dest
    return dest


# --- fleet collection: every host accounted for, one report ---------------------------------------


class _Collector:
    """One per pyinfra run and run id: knows each host's fate and writes the report once."""

    def __init__(self, pyinfra_state, results_dir: str, run_id: str, names: list[str]) -> None:
        self.state = pyinfra_state
        self.dir = run_dir(results_dir, run_id)
        self.run_id = run_id
        self.names = names
        pairs = all_pairs()  # a pair answers at its head: its headless members run no checks
        self.expected = [h.name for h in pyinfra_state.inventory if pyinfra_state.is_host_in_limit(h)
                         and (h.name not in pairs or pairs[h.name].is_head)]
        # Hosts already failed at plan time failed to connect.
        self.reasons: dict[str, str] = {
            h.name: "unreachable: pyinfra could not connect to the host" for h in pyinfra_state.failed_hosts
        }
        self.written: set = set()
        self.finished = False

    def record(self, host_name: str, result: dict) -> None:
        write_json(result_path(self.dir, host_name), result)
        self.written.add(host_name)

    def note_failures(self, op_names: Sequence[str]) -> None:
        # Called after each operation: a host newly failed failed in *that* operation.
        for h in self.state.failed_hosts:
            if h.name not in self.reasons:
                self.reasons[h.name] = f"failed in `{', '.join(op_names)}` before its checks ran"

    def finish(self) -> None:
        if self.finished:
            return
        self.finished = True
        for name in self.expected:
            if name not in self.written:
                reason = self.reasons.get(name, "did not finish its checks (see the pyinfra output)")
                self.record(name, failed_result(name, self.run_id, reason, self.names))
        try:
            from sparkfleet.bench import report

            report.write_and_print(self.dir)
        except Exception as exc:  # the results are on disk; `sparkfleet report` can retry
            print(f"sparkfleet: could not build the fleet report for {self.dir}: {exc}")


class _CollectorCallbacks(BaseStateCallback):
    def __init__(self, collector: _Collector) -> None:
        self.collector = collector

    def operation_end(self, pyinfra_state, op_hash) -> None:  # type: ignore[override]
        names = list(pyinfra_state.get_op_meta(op_hash).names)
        self.collector.note_failures(names)
        # pyinfra prefixes an operation's name with its deploy's ("sparkfleet checks | ...").
        if any(COLLECT_OP_NAME in name for name in names):
            self.collector.finish()


_COLLECTORS: dict[tuple, _Collector] = {}


def _collector_for(s: BenchSettings, run_id: str, names: list[str]) -> _Collector:
    current = state._get_module()  # the State itself, not pyinfra's context proxy
    key = (id(current), run_id)
    if key not in _COLLECTORS:
        collector = _Collector(current, s.results_dir, run_id, names)
        current.add_callback_handler(_CollectorCallbacks(collector))

        def at_exit() -> None:
            # --serial / --no-wait runs have no operation_end: finish here instead; a --dry
            # run never executed anything and writes nothing.
            if current.is_executing and not collector.finished:
                collector.finish()

        atexit.register(at_exit)
        _COLLECTORS[key] = collector
    return _COLLECTORS[key]


# --- execute-time callback, per host ---------------------------------------------------------------


def _run_and_collect(state, host, settings: BenchSettings, names: list[str],  # noqa: F811
                     run_id: str, collector: _Collector) -> bool:
    """Run the bench on the host, fetch its result; on any failure write one with the reason.

    Returns False (pyinfra marks the host failed) when a check failed or none could run.
    The parameters must be called ``state`` and ``host``: that is how python.call knows to
    pass them and to use the return value as the operation's success.
    """
    pyinfra_host = host
    command = bench_command(settings, names, run_id, pyinfra_host.name)
    done = host_commands.run(pyinfra_host, StringCommand(command), timeout=None, success_exit_codes=[0, 1],
                             print_output=True)
    remote = remote_paths(settings, run_id)["result"]
    result: dict | None = None
    if done.ok:
        buffer = io.BytesIO()
        try:
            host_commands.get(pyinfra_host, remote, buffer)
            result = json.loads(buffer.getvalue())
        except (OSError, ValueError, OperationError) as exc:
            result = failed_result(pyinfra_host.name, run_id, f"cannot fetch {remote}: {exc}", names)
    else:
        reason = failure_reason(done.stdout, done.stderr)
        result = failed_result(pyinfra_host.name, run_id, reason, names)
    result["host"] = pyinfra_host.name
    result["run_id"] = run_id
    result["collected_at"] = now_iso()
    result["runner"] = settings.bench_runner
    collector.record(pyinfra_host.name, result)
    if result.get("status") != "ok":
        pyinfra_host.log_styled(f"checks failed: {result.get('reason')}", fg="red")
        return False
    pyinfra_host.log_styled(f"checks passed -> {result_path(collector.dir, pyinfra_host.name)}", fg="green")
    return True


@deploy("sparkfleet checks")
def run_checks(names: Sequence[str] | str | None = None) -> None:
    """Run the named checks (smoke, tools, decode, e2e, agent) on this host and collect the result.

    + names: the checks; None reads data ``checks`` (``--data checks=smoke,decode``)

    **Example:**

    .. code:: python

        run_checks(["smoke", "decode"])
    """
    settings = bench_settings(fleet_settings(locked=False))  # nor sparkfleet.lock: checks fetch nothing
    wanted = parse_check_names(settings.checks if names is None else names)
    pair = all_pairs().get(host.name)
    if not wanted or (pair is not None and not pair.is_head):  # a pair is checked at its head
        return
    if "agent" in wanted and not settings.agent_state_db:
        raise ValueError(
            "the agent bench needs data agent_state_db: a Hermes state.db on the controller "
            "(e.g. --data agent_state_db=~/.hermes/state.db)"
        )
    run_id = run_id_for(settings)
    collector = _collector_for(settings, run_id, wanted)
    paths = remote_paths(settings, run_id)

    # Root-only: the state.db snapshot holds private conversations.
    files.directory(name="sparkfleet checks: bench directory", path=settings.bench_dir, mode="0700")
    files.sync(
        name="sparkfleet checks: upload the bench program",
        src=str(ONHOST_SRC),
        dest=paths["code"],
        delete=True,
        exclude=["*.pyc"],
        exclude_dir=["__pycache__"],
    )
    if "agent" in wanted:
        python.call(  # 0600 from its first byte (files.put with sudo passes through /tmp as 0644)
            name="sparkfleet checks: upload the state.db snapshot",
            function=host_commands.uploaded,
            source=snapshot_state_db(str(settings.agent_state_db)),
            dest=paths["state_db"],
            mode="0600",
        )
    python.call(
        name=COLLECT_OP_NAME,
        function=_run_and_collect,
        settings=settings,
        names=wanted,
        run_id=run_id,
        collector=collector,
    )
