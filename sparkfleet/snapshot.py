"""One read of a host's state per run: the files, units and trees the deploy manages.

pyinfra 3 caches no fact, so every ``files.put`` asks three questions (the file's stat,
its directory's stat, its hash), every ``systemd.service`` two, ``files.sync`` three per
file: ~160 commands per host on a converged run, each a new SSH channel and a sudo.
Here the steps declare while the deploy plans what they will compare (:func:`expect`,
called by :func:`file`, :func:`service` and :func:`tree` themselves), and one command
reads all of it (:mod:`sparkfleet.hostread`, a small Python program: DGX OS has python3);
operations read the answer. The host's first read runs inside the run's sudo check
(:func:`first_read`: one sudo, one password hash), with what the steps declared as they
loaded and the host's hint of what its later reads asked last run. What is declared
after that (or not at all) is read, with everything else not read yet, when first asked for.

An operation that changes anything on the host drops its snapshot: what is asked after
that is read again, with the files, texts and programs nobody asked yet; facts, units,
trees and sizes (a program each, or a server asked) only as they are asked, unless the
host is read again before another change. So an operation always reads what is there
before it runs, the answer its own fact would give, a converged run reads each host once,
and a first deploy, which changes a host at nearly every step, does not read every fact
again at each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyinfra import host
from pyinfra.api import StringCommand, operation
from pyinfra.api.state import BaseStateCallback

from sparkfleet import hostread, remote
from sparkfleet.hostread import _MISSING, UNIT_PROPERTIES, HostState
from sparkfleet.perrun import once


@dataclass
class _Wanted:
    files: set[str] = field(default_factory=set)
    texts: set[str] = field(default_factory=set)
    trees: set[str] = field(default_factory=set)
    units: set[str] = field(default_factory=set)
    programs: set[str] = field(default_factory=set)
    sizes: set[str] = field(default_factory=set)
    facts: dict[str, str] = field(default_factory=dict)  # key -> the fact's shell command

    def json(self) -> str:
        return json.dumps({"files": sorted(self.files), "texts": sorted(self.texts), "trees": sorted(self.trees),
                           "units": sorted(self.units), "programs": sorted(self.programs),
                           "sizes": sorted(self.sizes), "facts": self.facts, "props": list(UNIT_PROPERTIES),
                           "engine": {k: _ENGINE_PATHS[k] for k in self.facts if k in _ENGINE_PATHS},
                           "python": {k: _PYTHON_PROGRAMS[k] for k in self.facts if k in _PYTHON_PROGRAMS},
                           "docker_socket": hostread.DOCKER_SOCKET})


#: Constant paths that steps read while the deploy plans, declared as their modules load
#: (:func:`expect_first`): every host's first read takes them along.
_FIRST = _Wanted()


def _wanted(name: str, state=None) -> _Wanted:
    return once(("snapshot wanted", name), lambda: _Wanted(
        *(set(getattr(_FIRST, k)) for k in ("files", "texts", "trees", "units", "programs", "sizes")),
        facts=dict(_FIRST.facts)), state)


def expect_first(*, files=(), texts=(), units=(), programs=(), facts=()) -> None:
    """Declare, when a step's module loads, constant paths, units and facts (``(fact
    class, its arguments)`` pairs) that step reads while the deploy plans. The first step
    to read (preflight) reads them too, so a later step's planning finds them read rather
    than running a command of its own: one sudo each on a host, its password's hash
    checked again."""
    _FIRST.files.update(files)
    _FIRST.texts.update(texts)
    _FIRST.units.update(units)
    _FIRST.programs.update(programs)
    _FIRST.facts.update(_fact_entry(cls, kwargs) for cls, kwargs in facts)


def expect(*, files=(), texts=(), trees=(), units=(), programs=(), sizes=(), facts=()) -> None:
    """Declare, while the deploy plans, what the current host's operations will compare
    (``facts``: (fact class, its arguments) pairs, read with the rest)."""
    wanted = _wanted(host.name)
    wanted.files.update(files)
    wanted.texts.update(texts)
    wanted.trees.update(trees)
    wanted.units.update(units)
    wanted.programs.update(programs)
    wanted.sizes.update(sizes)
    wanted.facts.update(_fact_entry(cls, kwargs) for cls, kwargs in facts)


_KINDS = ("files", "texts", "trees", "units", "programs", "sizes", "facts")
#: What a read right after a change takes only when asked (each costs a program, a server's
#: answer or a walk of a tree); files, texts and programs cost a stat or a small read.
_WHEN_ASKED = ("facts", "units", "trees", "sizes")


class _Forget(BaseStateCallback):
    """Drops a host's snapshot once an operation changed something on it: what is read
    after that is read again (one command for all of it)."""

    @staticmethod
    def operation_end(state, op_hash):
        for target in state.inventory:
            try:
                meta = state.get_op_data_for_host(target, op_hash).operation_meta
            except KeyError:
                continue
            if meta.is_complete() and meta.did_change():
                _drop(target.name, state)


def _drop(name: str, state=None) -> None:
    """Forget what was read of the host ``name``: a change may have moved any of it."""
    known = _known(name, state)
    for kind in _KINDS:
        known[kind].clear()
    known["changed"] = True  # until the next read


def _known(name: str, state=None) -> dict[str, Any]:  # each kind's answers, "cpus", "changed"
    return once(("snapshot", name), lambda: {**{k: {} for k in _KINDS}, "cpus": None, "changed": False}, state)


_ENGINE_PATHS: dict[str, tuple[str, bool]] = {}  # fact key -> hostread.engine_request's, as facts are declared
#: fact key -> [program, *argv] of a fact whose command is exactly ``python3 -c PROGRAM ARGS``:
#: the reader runs it in its own interpreter (a python3 start costs a host ~12 ms of CPU).
_PYTHON_PROGRAMS: dict[str, list[str]] = {}


def _fact_entry(cls, kwargs: dict) -> tuple[str, str]:
    """(key, shell command) of a pyinfra fact, its command built as pyinfra builds it (a
    missing ``requires_command`` prints pyinfra's marker: the fact's default)."""
    args = {k: v for k, v in kwargs.items() if not k.startswith("_")}  # _sudo...: pyinfra's own
    key = f"{cls.__module__}.{cls.__name__}:{json.dumps(args, sort_keys=True, default=str)}"
    if key not in _COMMANDS:  # every host asks the same facts: each command built once
        _COMMANDS[key] = _fact_command(cls, args, key)
    return key, _COMMANDS[key]


#: fact key -> its shell command (a fact's command depends on its class and arguments alone).
_COMMANDS: dict[str, str] = {}


def _fact_command(cls, args: dict, key: str) -> str:
    made = cls().command(**args)
    command = made.get_raw_value() if isinstance(made, StringCommand) else str(made)
    needs = cls().requires_command(**args)
    if needs:
        command = f"if command -v {needs} >/dev/null 2>&1; then ( {command} ); else echo '{_MISSING}'; fi"
    request = hostread.engine_request(cls, args)
    if request:
        _ENGINE_PATHS[key] = request
    program = _python_program(command)
    if program:
        _PYTHON_PROGRAMS[key] = list(program)
    return command


def _python_program(command: str) -> tuple[str, ...] | None:
    """[program, *argv] of a command that is exactly ``python3 -c PROGRAM ARGS``, else None."""
    if not command.startswith("python3 -c "):
        return None
    try:
        argv = shlex.split(command)
    except ValueError:  # quoting of the shell's own that shlex does not read
        return None
    return tuple(argv[2:]) if len(argv) > 2 and shlex.join(argv) == command else None  # nothing of the shell's in it


def fact(cls, **kwargs):
    """``host.get_fact(cls, **kwargs)``, read with the snapshot (one command for all that
    is declared) and asked once until an operation changes the host. A command that fails
    is asked again through pyinfra itself, which reports it as it always does."""
    key, _ = entry = _fact_entry(cls, kwargs)
    _wanted(host.name).facts.setdefault(*entry)
    lines = _read("facts", key)
    if lines is None:
        return host.get_fact(cls, **kwargs)
    if _MISSING in lines:
        return cls().default()
    return cls().process(lines)


def fact_of(target, cls, state=None, **kwargs):
    """:func:`fact` of ``target``, which need not be the host planning now (the fleet asks
    every host its routes): its answer when a read of ``target`` took it along, else asked
    alone, and read with that host's first read from the next run on."""
    key, _ = entry = _fact_entry(cls, kwargs)
    _wanted(target.name, state).facts.setdefault(*entry)
    lines = _known(target.name, state)["facts"].get(key)
    if lines is None:
        return target.get_fact(cls, **kwargs)
    _asked(target.name, state).add(("facts", key))
    return cls().default() if _MISSING in lines else cls().process(lines)


def _read(kind: str, key: str):
    """What the host holds for ``key``: read with everything declared and not read yet,
    in one command, the first time any of it is asked for."""
    once("snapshot forgets", lambda: [host.state.add_callback_handler(c) for c in (_Forget(), _KeepHint())])
    wanted = _wanted(host.name)
    if kind != "facts":
        getattr(wanted, kind).add(key)  # one nobody declared is read too
    known = _known(host.name)
    if key not in known[kind]:
        _read_unread(wanted, known, (kind, key))
    _asked().add((kind, key))
    return known[kind][key]


def _asked(name: str | None = None, state=None) -> set[tuple[str, str]]:
    """(kind, key) of every answer this run's operations asked of the host (the current one)."""
    return once(("snapshot asked", name or host.name), set, state)


def _read_unread(wanted: _Wanted, known: dict, asking: tuple[str, str] | None = None) -> None:
    """Everything declared and not read yet, in one command, into ``known``."""
    missing = _unread(host, wanted, known, asking)
    _took(host, known, missing, host.get_fact(HostState, want=missing.json()))


def _unread(target, wanted: _Wanted, known: dict, asking: tuple[str, str] | None = None, state=None) -> _Wanted:
    """What ``target``'s next read asks: everything declared and not read yet. The host's
    first read of the run takes along what its later reads asked last time (:func:`_hinted`);
    a later read means the hint fell short: what it asks is added to it. What was ``asked`` (kind,
    key) already is read again only when asked again: once a change dropped the snapshot,
    a first deploy's next read would otherwise read every fact again (it made ~30 full
    reads of each host)."""
    # The hint as the run found it, read once per host and run (a first deploy reads a host ~30 times).
    hint = once(("snapshot hint", target.name), lambda: _hinted(target), state)
    if not _reads(target.name, state)[0]:
        wanted = _joined(wanted, hint)
    else:  # what the hint named stays: a read in the middle of planning knows only what came before it
        _keep_hint(_joined(wanted, hint), target)

    asked = _asked(target.name, state) - {asking}
    # The first read after a change takes what costs a program or a server only as it is
    # asked: the next step's change would drop it unused (a 1-host first deploy: 60 reads
    # and 46.9 s of the host's CPU with the pending facts in each, 56 and 45.9 s without).
    lean = known["changed"]

    def unread(kind: str, keys) -> set:
        if lean and kind in _WHEN_ASKED:
            keys = [k for k in keys if (kind, k) == asking]
        return {k for k in keys if k not in known[kind] and (kind, k) not in asked}

    return _Wanted(*(unread(k, getattr(wanted, k)) for k in _KINDS if k != "facts"),
                   facts={k: c for k, c in wanted.facts.items() if k in unread("facts", wanted.facts)})


def _joined(one: _Wanted, other: _Wanted) -> _Wanted:
    return _Wanted(*(getattr(one, k) | getattr(other, k) for k in _KINDS if k != "facts"),
                   facts={**other.facts, **one.facts})


def _reads(name: str, state=None) -> list[int]:
    return once(("snapshot reads", name), lambda: [0], state)


def _took(target, known: dict, missing: _Wanted, found: dict, state=None) -> None:
    _reads(target.name, state)[0] += 1
    known["changed"] = False
    known["cpus"] = found.get("cpus")
    for k in _KINDS:
        known[k].update({name: found.get(k, {}).get(name) for name in getattr(missing, k)})


@dataclass
class FirstRead:
    """A host's first read of the run, for the sudo check to run in its own sudo: one
    password hash on the host serves both (a hash is the largest cost of a converged run
    on a host). ``argv``: the reader's command; :meth:`took` keeps what it printed."""

    target: Any
    state: Any
    missing: _Wanted
    argv: list[str]

    def took(self, lines: list[str] | None) -> None:
        """The reader's output (None: it did not run): the host's first read, when it is
        one; anything else leaves the read to the first step that asks, as before."""
        found = HostState().process(lines) if lines else None
        if not found or not any(found.get(k) for k in _KINDS):
            return
        if not _reads(self.target.name, self.state)[0]:
            _took(self.target, _known(self.target.name, self.state), self.missing, found, self.state)


def first_read(target, state=None) -> FirstRead | None:
    """``target``'s first read of the run, while the deploy plans: what the steps declared
    as they loaded and what its later reads asked last run (on a converged run: all it
    will read). None when no step declares anything (a run of the checks alone)."""
    if not any(getattr(_FIRST, k) for k in _KINDS):
        return None
    missing = _unread(target, _wanted(target.name, state), _known(target.name, state), state=state)
    return FirstRead(target, state, missing, HostState().argv(missing.json()))


# --- hints: what a host's later reads asked, kept on the controller ---------------------------


class _KeepHint(BaseStateCallback):
    """After a host's last operation, its hint becomes what this run declared and asked,
    when it names anything else: what no step asks any more (``docker info``, which only an
    image still to come needs) would otherwise be read by every run after, and what the
    fleet asked of the host alone (its routes) would be asked alone again."""

    @staticmethod
    def operation_host_success(state, host, op_hash, retry_count=0):
        if not host.op_hash_order or host.op_hash_order[-1] != op_hash:
            return
        wanted = _wanted(host.name, state)  # declared, and asked (a read adds what it asks)
        try:
            doc = json.loads(_hint_path(host).read_text())
        except (OSError, ValueError):
            doc = {}
        named = {(kind, key) for kind in _KINDS for key in doc.get(kind, [])}
        if named != {(kind, key) for kind in _KINDS for key in getattr(wanted, kind)}:
            _keep_hint(wanted, host)


#: Where the controller keeps, per host, what its reads after the first asked in the last
#: run: the steps declare most of it after the first read (the sudo check's), so a
#: converged run would read each host twice. A hint names paths, units and facts, never a value: every answer
#: is still read from the host, and a missing or stale hint costs a command, not an answer.
HINTS = Path(__file__).resolve().parents[1] / ".sparkfleet" / "snapshot-hints"
_HINTED_MODULES = ("sparkfleet.", "pyinfra.facts.")


def _hint_path(target=None) -> Path:
    target = host if target is None else target
    # Two fleets may name hosts alike (two inventories of one checkout, the test suite's
    # fleets side by side): the address its connection reached tells them apart, where no
    # ssh_hostname does (a name an ssh_config resolves).
    key = f"{target.name} {target.data.get('ssh_hostname') or ''} {_peer(target)}"
    return HINTS / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _peer(target) -> str:
    """The address ``target``'s SSH connection reached, as the controller sees it ("" when
    there is none: not connected, or not over SSH)."""
    try:
        return str(target.connector.client.get_transport().getpeername()[0])
    except (AttributeError, OSError, TypeError, IndexError):
        return ""


def _hinted(target=None) -> _Wanted:
    """The host's hint (empty when there is none), facts built by this code."""
    try:
        doc = json.loads(_hint_path(target).read_text())
    except (OSError, ValueError):
        return _Wanted()
    facts = dict(filter(None, (_entry_of(key) for key in doc.get("facts", []))))
    return _Wanted(*(set(doc.get(k, [])) for k in _KINDS if k != "facts"), facts=facts)


def _entry_of(key: str) -> tuple[str, str] | None:
    """The (key, command) of a fact named by its key, when this code still has that fact."""
    import importlib

    name, _, args = key.partition(":")
    module, _, cls = name.rpartition(".")
    if not module.startswith(_HINTED_MODULES):
        return None
    try:
        entry = _fact_entry(getattr(importlib.import_module(module), cls), json.loads(args))
    except (ImportError, AttributeError, ValueError, TypeError):
        return None
    return entry if entry[0] == key else None


def _keep_hint(wanted: _Wanted, target=None) -> None:
    doc = {k: sorted(getattr(wanted, k)) for k in _KINDS if k != "facts"} | {"facts": sorted(wanted.facts)}
    path = _hint_path(target)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = path.with_suffix(f".{os.getpid()}.tmp")
        kept.write_text(json.dumps(doc))
        os.replace(kept, path)
    except OSError:
        pass  # a hint not kept costs the next run a command


def file_state(path: str) -> tuple[int, str, str] | None:
    """(mode, "user:group", sha256) of ``path`` before this run changed it, None if missing."""
    found = _read("files", path)
    return tuple(found) if found else None


def text(path: str) -> str | None:
    """The content of a small text file before this run changed it, None if missing."""
    return _read("texts", path)


def first_line(path: str) -> str | None:
    content = text(path)
    return content.splitlines()[0].strip() if content and content.strip() else None


def unit(name: str) -> dict[str, str]:
    """A unit's :data:`UNIT_PROPERTIES` before this run changed it ({} if systemd has none)."""
    return _read("units", name) or {}


def program(name: str) -> str | None:
    """Where the command ``name`` is on the host's PATH (sbin included), None if nowhere:
    pyinfra's ``server.Which``, read from the snapshot."""
    return _read("programs", name)


def size(path: str) -> int:
    """Bytes under ``path`` as ``du -sb`` counts them (0 when missing)."""
    return _read("sizes", path) or 0


def cpus() -> int:
    """The host's online processors (read with the rest of the snapshot)."""
    known = _known(host.name)
    if known["cpus"] is None:
        _read_unread(_wanted(host.name), known)
    return int(known["cpus"] or 1)


def tree_hash(path: str) -> str:
    return _read("trees", path) or ""


# --- operations that compare against the snapshot ---------------------------------------------


@operation()
def _file(path: str, content: bytes | None, src: str | None, mode: int, owner: str):
    if content is None and src is not None and Path(src).is_file():
        content = Path(src).read_bytes()
    if content is not None and file_state(path) == (mode, owner, hashlib.sha256(content).hexdigest()):
        host.noop(f"{path} is up to date")
        return
    # mode and owner from the first byte: never a world-readable upload in /tmp (remote.put);
    # its directory made in the same sudo.
    yield remote.callback(remote.uploaded, content if content is not None else src, path, f"{mode:04o}", owner,
                          parent=True)


def file(path: str, content: str | bytes | None = None, src: str | None = None, mode: str = "644",
         owner: str = "root:root", **op_args):
    """An operation: ``path`` holds ``content`` (or the controller's file ``src``, read when
    the operation runs: it may be made by an earlier one) with ``mode`` and ``owner``;
    compared by hash, so a secret's content is never printed."""
    expect(files=[path])
    data = content.encode() if isinstance(content, str) else content
    return _file(path=path, content=data, src=src, mode=int(mode, 8), owner=owner, **op_args)


def template(path: str, src: str, mode: str = "644", owner: str = "root:root", op_args: dict | None = None,
             **context):
    """An operation: ``path`` holds the jinja2 template ``src`` rendered with ``context``,
    as pyinfra's ``files.template`` renders it (``op_args``: name, _if...)."""
    from pyinfra.api.util import get_template

    return file(path, get_template(src).render(context), mode=mode, owner=owner, **(op_args or {}))


@operation()
def _directory(path: str, mode: int, owner: str):
    if file_state(path) == (mode, owner, "directory"):
        host.noop(f"{path} is in place")
        return
    q = shlex.quote
    yield f"mkdir -p {q(path)} && chmod {mode:04o} {q(path)} && chown {q(owner)} {q(path)}"


def directory(path: str, mode: str = "755", owner: str = "root:root", **op_args):
    """An operation: directory ``path`` exists with ``mode`` and ``owner`` (not recursive)."""
    expect(files=[path])
    return _directory(path=path, mode=int(mode, 8), owner=owner, **op_args)


@operation()
def _service(unit_name: str, running: bool | None, enabled: bool | None):
    name = unit_name
    state = unit(name)
    commands = []
    if enabled is not None and (state.get("UnitFileState") in ("enabled", "enabled-runtime", "static")) != enabled:
        commands.append(f"systemctl {'enable' if enabled else 'disable'} {name}")
    if running is not None and (state.get("ActiveState") in ("active", "activating", "reloading")) != running:
        commands.append(f"systemctl {'start' if running else 'stop'} {name}")
    if not commands:
        host.noop(f"{name} is {'running' if running else 'stopped' if running is False else 'as wanted'}")
        return
    yield from commands


def service(unit_name: str, running: bool | None = True, enabled: bool | None = True, **op_args):
    """An operation: systemd unit ``unit_name`` running (or stopped) and enabled (or not),
    as pyinfra's ``systemd.service`` but read from the snapshot."""
    expect(units=[unit_name])
    return _service(unit_name=unit_name, running=running, enabled=enabled, **op_args)


# --- a directory of the controller, kept identical on the host -------------------------------

FILE_MODE, DIR_MODE, OWNER = 0o644, 0o755, "root:root"


def _kept(rel: Path) -> bool:
    return "__pycache__" not in rel.parts and rel.suffix != ".pyc"


def _entries(root: Path) -> list[Path]:
    return sorted((p for p in root.rglob("*") if _kept(p.relative_to(root))), key=lambda p: p.relative_to(root).as_posix())


def manifest_hash(root: Path) -> str:
    """The manifest hash ``root`` has on a host once copied (fixed modes, owned by root)."""
    lines = [f"{p.relative_to(root).as_posix()} d {DIR_MODE:o} {OWNER} -" if p.is_dir() else
             f"{p.relative_to(root).as_posix()} f {FILE_MODE:o} {OWNER} {hashlib.sha256(p.read_bytes()).hexdigest()}"
             for p in _entries(root)]
    lines.sort(key=lambda line: line.split(" ", 1)[0].encode())
    return hashlib.sha256("".join(f"{line}\n" for line in lines).encode()).hexdigest()


def tarball(root: Path) -> bytes:
    """``root`` as a gzipped tar with the modes and owner the manifest expects."""
    import gzip
    import io
    import tarfile

    buffer = io.BytesIO()
    # mtime=0 in the gzip header too: the same tree makes the same bytes.
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as packed, tarfile.open(fileobj=packed, mode="w") as tar:
        for path in _entries(root):
            info = tar.gettarinfo(str(path), arcname=path.relative_to(root).as_posix())
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            info.mtime = 0
            info.mode = DIR_MODE if path.is_dir() else FILE_MODE
            if path.is_dir():
                tar.addfile(info)
            else:
                with path.open("rb") as f:
                    tar.addfile(info, f)
    return buffer.getvalue()


@operation()
def _tree(src: str, dest: str):
    if tree_hash(dest) == once(("manifest hash", src), lambda: manifest_hash(Path(src))):  # the same for every host
        host.noop(f"{dest} matches {src}")
        return
    q = shlex.quote
    staged = f"{dest}.tar.gz"
    yield remote.callback(remote.uploaded, tarball(Path(src)), staged, "0600", parent=True)
    # Replaced whole: a reader sees the old tree or the new one, never half of each.
    yield (f"rm -rf {q(dest)}.new && mkdir -p -m 0755 {q(dest)}.new && "
           f"tar -xzf {q(staged)} -C {q(dest)}.new --no-same-owner && chmod 0755 {q(dest)}.new && "
           f"rm -rf {q(dest)}.old && {{ [ ! -e {q(dest)} ] || mv {q(dest)} {q(dest)}.old; }} && "
           f"mv {q(dest)}.new {q(dest)} && rm -rf {q(dest)}.old {q(staged)}")


def tree(src: str, dest: str, **op_args):
    """An operation: directory ``dest`` holds exactly the files of the controller's ``src``
    (``__pycache__`` and ``*.pyc`` aside), 0644 files and 0755 directories owned by root;
    compared by one manifest hash, copied as one tarball when it differs."""
    expect(trees=[dest])
    return _tree(src=src, dest=dest, **op_args)
