"""The fleet lock, ``sparkfleet.lock``: the bytes the fleet serves, resolved once.

``image`` may name a tag and ``model_revisions`` a branch (``main`` by default): names
whose target moves upstream. A host that fetched them would keep what they meant on the
day it fetched, and a host added later would get what they mean then (the 122B DFlash
drafter was replaced on its ``main`` in June 2026). So the first deploy resolves each
such name once, on the controller (the image's tag to its manifest digest at its
registry, a branch or tag to a commit at the hub), and writes the answers into
``sparkfleet.lock`` beside the inventory; every later deploy reads them from there and
serves exactly those bytes, whatever upstream does since. As Cargo.lock, Terraform's
``.terraform.lock.hcl``, ``flake.lock`` and pip-tools' pins: a readable, diffable
file, committed with the inventory, never changed behind the operator's back; moving a
reference is a command of its own (``--data fleet_lock_update=...``: Cargo's ``update -p``,
Terraform's ``init -upgrade``, ``nix flake update <input>``), which prints old -> new.

A reference that enters the lock while hosts already hold it (a fleet deployed before
the lock existed) takes what they hold, so adopting the lock moves nothing; when they
hold different bytes, which ones the fleet serves is the operator's choice, and the
deploy stops, naming each host's commit or digest.

The controller asks upstream with plain HTTP (the hub's ``/api/models/{repo}/revision/
{rev}`` and the registry's ``/v2/{path}/manifests/{tag}``, anonymous or with the HF
token): only when a reference enters the lock or is moved, never on a deploy that finds
the lock complete.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal
from urllib.parse import quote, urlencode

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, deploy, operation

from sparkfleet.config import ConfigError, ImageName, Settings, hf_token, upstream_registry_url
from sparkfleet.facts import MANIFEST_ACCEPT
from sparkfleet.hostpaths import local_image

#: The file's name beside the inventory (or in the current directory, ``fleet_lock_file``).
LOCK_NAME = "sparkfleet.lock"
VERSION = 1
HUB = "https://huggingface.co"
GIB = 1024**3
_COMMIT = re.compile(r"^[0-9a-f]{40}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")

HEADER = f"""\
# {LOCK_NAME}: the bytes this fleet serves, resolved once by sparkfleet (README: "The fleet lock").
# Commit it with the inventory. Every host, one added months later too, serves exactly what it
# names, whatever upstream's tags and branches point at since; a deploy never moves it.
# `pyinfra INVENTORY deploy.py --data fleet_lock_update=all` (or `image`, or a repo id) resolves again,
# prints old -> new, and rolls the change through the rolling gate; add --dry to only see it.
# An entry deleted by hand is resolved again on the next deploy.
"""


class LockError(ConfigError):
    """The lock cannot be read or completed; raised before any host changes."""


# --- the file -----------------------------------------------------------------------------------


class Reference:
    """What an image (its reference) or a model (repo and revision asked for) is called."""

    kind: str
    name: str
    asked: str

    @property
    def key(self) -> str:
        return self.name if self.kind == "image" else f"{self.name}@{self.asked}"

    @property
    def label(self) -> str:
        return f"image {self.name}" if self.kind == "image" else self.key


@dataclass(frozen=True)
class Entry(Reference):
    """One locked reference: what was asked for and the bytes it resolved to."""

    kind: Literal["image", "model"]
    name: str  # image: the reference asked for (registry/path:tag); model: the repo id
    asked: str  # image: that reference again; model: the branch, tag or commit asked for
    pin: str  # image: the manifest digest (sha256:...); model: the commit (40 hex)
    size: int | None = None  # bytes: the compressed image, or every file of the commit
    resolved: str = ""  # when (UTC, ISO 8601)
    source: str = ""  # where from: upstream's URL, or the hosts that held it

    @property
    def short(self) -> str:
        return self.pin[:19] if self.kind == "image" else self.pin[:12]


@dataclass(frozen=True)
class FleetLock:
    entries: dict[str, Entry] = field(default_factory=dict)  # by Entry.key

    def get(self, key: str) -> Entry | None:
        return self.entries.get(key)

    def with_entries(self, entries: Iterable[Entry]) -> FleetLock:
        return FleetLock({**self.entries, **{e.key: e for e in entries}})


def render(lock: FleetLock) -> str:
    """The file's text: the header, then one table per entry, images first, each sorted (a
    diff of two locks shows only what moved)."""
    lines = [HEADER, f"version = {VERSION}"]
    for entry in sorted(lock.entries.values(), key=lambda e: (e.kind != "image", e.key)):
        lines.append("")
        if entry.kind == "image":
            lines += ["[[image]]", f"reference = {_q(entry.name)}", f"digest = {_q(entry.pin)}"]
        else:
            lines += ["[[model]]", f"repo = {_q(entry.name)}", f"revision = {_q(entry.asked)}",
                      f"commit = {_q(entry.pin)}"]
        if entry.size is not None:
            what = "compressed, as the registry sends it" if entry.kind == "image" else "every file of the commit"
            lines.append(f"size = {entry.size}  # {size_text(entry.size)}, {what}")
        lines += [f"resolved = {_q(entry.resolved)}", f"source = {_q(entry.source)}"]
    return "\n".join(lines) + "\n"


def _q(text: str) -> str:
    return json.dumps(text)  # a TOML basic string: JSON's escapes are TOML's


def parse(text: str, where: str = LOCK_NAME) -> FleetLock:
    """The lock in ``text``; LockError naming the file, the entry and the fix."""
    fix = f"fix that entry of {where}, or delete it (it is resolved again on the next deploy)"
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise LockError(f"{where} is not valid TOML ({exc}), nothing was changed on any host. Fix: restore it "
                        f"from version control, or delete it (the next deploy resolves every reference again)"
                        ) from None
    if doc.get("version") != VERSION:
        raise LockError(f"{where}: version {doc.get('version')!r}, this sparkfleet reads version {VERSION}, "
                        "nothing was changed on any host. Fix: use the sparkfleet that wrote it")
    entries: list[Entry] = []
    for kind, name_key, asked_key, pin_key, pin_ok in (
            ("image", "reference", "reference", "digest", _DIGEST), ("model", "repo", "revision", "commit", _COMMIT)):
        for i, table in enumerate(doc.get(kind, [])):
            name, asked, pin = table.get(name_key), table.get(asked_key), table.get(pin_key)
            size = table.get("size")
            if not (isinstance(name, str) and isinstance(asked, str) and isinstance(pin, str) and pin_ok.match(pin)) \
                    or not (size is None or isinstance(size, int)):
                raise LockError(f"{where}: [[{kind}]] #{i + 1} ({name or '?'}) needs {name_key}, "
                                f"{asked_key + ', ' if asked_key != name_key else ''}{pin_key} "
                                f"({'sha256:<64 hex>' if kind == 'image' else '40 hex'}) and an integer size, "
                                f"nothing was changed on any host. Fix: {fix}")
            entries.append(Entry(kind, name, asked, pin, size, str(table.get("resolved", "")),
                                 str(table.get("source", ""))))
    lock = FleetLock({e.key: e for e in entries})
    if len(lock.entries) != len(entries):
        raise LockError(f"{where} names a reference twice, nothing was changed on any host. Fix: keep one entry each")
    return lock


def read(path: Path) -> tuple[FleetLock, str | None]:
    """The lock at ``path`` and its text (an empty lock and None when there is no file)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return FleetLock(), None
    return parse(text, str(path)), text


def lock_path(fleet_lock_file: str | None, inventory: str | None) -> Path:
    """Where the lock lives: ``fleet_lock_file``, else beside the inventory file, else (an
    inventory that is a list of hosts, or none known) the current directory."""
    if fleet_lock_file:
        return Path(fleet_lock_file).expanduser()
    if inventory and Path(inventory).is_file():
        return Path(inventory).parent / LOCK_NAME
    return Path(LOCK_NAME)


def cli_params() -> dict[str, Any]:
    """The running ``pyinfra`` command's arguments ({} outside its CLI): its command line
    parsed again by pyinfra's own parser (deploy files are planned in greenlets, which do
    not see click's context of the command)."""
    import sys

    main = getattr(sys.modules.get("__main__"), "__spec__", None)
    cli = getattr(sys.modules.get("pyinfra_cli.cli"), "cli", None)  # imported by the CLI only
    if cli is None or not (Path(sys.argv[0]).name == "pyinfra" or getattr(main, "name", "").startswith("pyinfra")):
        return {}
    try:
        return dict(cli.make_context("pyinfra", sys.argv[1:], resilient_parsing=True).params)
    except Exception:  # noqa: BLE001 - not pyinfra's command line after all
        return {}


# --- what the fleet asks for ------------------------------------------------------------------


@dataclass(frozen=True)
class Wanted(Reference):
    """A reference some hosts ask for, and where upstream answers for it."""

    kind: Literal["image", "model"]
    name: str
    asked: str
    hosts: tuple[str, ...]
    where: str  # the registry's or the hub's URL

    @property
    def moving(self) -> bool:
        """A tag or a branch: what it names can change upstream (a digest or a commit cannot)."""
        if self.kind == "image":
            return ImageName.parse(self.asked).digest is None
        return not _COMMIT.match(self.asked)

    @property
    def pinned(self) -> str | None:
        if self.kind == "image":
            return ImageName.parse(self.asked).digest
        return self.asked if _COMMIT.match(self.asked) else None


def wanted(settings: dict[str, Settings]) -> dict[str, Wanted]:
    """Every reference of the fleet, by key, with the hosts that ask for it (inventory order)."""
    found: dict[str, Wanted] = {}

    def add(w: Wanted) -> None:
        known = found.get(w.key)
        found[w.key] = replace(known, hosts=(*known.hosts, *w.hosts)) if known else w

    for name, s in settings.items():  # a host stopped (serving=false) keeps its references
        add(Wanted("image", s.image, s.image, (name,), upstream_registry_url(s.image, s.image_registry_url)))
        for repo in s.hub_repos:
            add(Wanted("model", repo, s.revision(repo), (name,), (s.hf_endpoint or HUB).rstrip("/")))
    return found


def locked(settings: Settings, lock: FleetLock) -> Settings:
    """``settings`` with every reference the lock names replaced by its bytes: the image
    as ``reference@digest`` (the tag kept for the reader), each hub repository's
    revision as its commit. serve.env, the downloads and their markers, the unit's image
    and a pair's validation then all see the locked bytes."""
    image = settings.image
    entry = lock.get(image)
    if entry is not None and ImageName.parse(image).digest is None:
        image = f"{image}@{entry.pin}"
    revisions = dict(settings.model_revisions)
    for repo in settings.hub_repos:
        entry = lock.get(f"{repo}@{settings.revision(repo)}")
        if entry is not None:
            revisions[repo] = entry.pin
    return settings.model_copy(update={"image": image, "model_revisions": revisions})


# --- asking upstream ----------------------------------------------------------------------------


class Unresolved(Exception):
    """Upstream did not answer for a reference: what went wrong, and ``fix``."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.fix = fix


def _unreachable(where: str, exc: Exception) -> Unresolved:
    return Unresolved(f"the controller cannot reach {where} ({type(exc).__name__})",
                      f"let the controller reach {where} (it asks once, when a reference enters {LOCK_NAME}), "
                      "or pin the reference (a digest, a commit)")


class Upstream:
    """The hub and the image's registry, asked from the controller (``requests``)."""

    def __init__(self, timeout: float = 30) -> None:
        import requests

        self.http = requests.Session()
        self.timeout = timeout

    def model(self, endpoint: str, repo: str, revision: str, token: str | None) -> tuple[str, int | None]:
        """(commit, bytes of its files) of ``repo@revision`` at the hub ``endpoint``."""
        import requests

        url = f"{endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            answer = self.http.get(url, params={"blobs": "true"}, headers=headers, timeout=self.timeout)
        except requests.RequestException as exc:
            raise _unreachable(endpoint, exc) from None
        code = answer.headers.get("X-Error-Code", "")
        if answer.status_code == 404 and code == "RevisionNotFound":
            raise Unresolved(f"{repo} has no revision {revision!r} at {endpoint}",
                             "set model_revisions to a branch, tag or commit of it")
        if answer.status_code in (401, 403, 404):
            raise Unresolved(f"{endpoint} does not show {repo} (HTTP {answer.status_code}{' ' + code if code else ''})",
                             "check the repo id, and hf_token (else the controller's HF_TOKEN)")
        if answer.status_code != 200:
            raise Unresolved(f"{endpoint} answered HTTP {answer.status_code} for {repo}@{revision}",
                             "try again, or pin the revision to a commit")
        doc = answer.json()
        commit = str(doc.get("sha") or "")
        if not _COMMIT.match(commit):
            raise Unresolved(f"{endpoint} gave no commit for {repo}@{revision}", "pin the revision to a commit")
        sizes = [s.get("size", (s.get("lfs") or {}).get("size")) for s in doc.get("siblings") or []]
        return commit, (sum(sizes) if sizes and all(isinstance(n, int) for n in sizes) else None)

    def image(self, registry_url: str, reference: str) -> tuple[str, int | None]:
        """(manifest digest, compressed bytes) of ``reference``'s tag or digest at the
        registry ``registry_url`` (anonymously, or with the token its challenge offers)."""
        name = ImageName.parse(reference)
        doc, digest = self._manifest(registry_url, name.path, name.digest or name.tag or "latest")
        size = None
        if "manifests" in doc:  # an index: the arm64 image's size (a Spark is arm64)
            children = doc["manifests"]
            arm = [m for m in children if (m.get("platform") or {}).get("architecture") == "arm64"]
            child = (arm or children or [{}])[0].get("digest")
            doc = self._manifest(registry_url, name.path, child)[0] if child else {}
        if "layers" in doc:
            size = int(doc.get("config", {}).get("size", 0)) + sum(int(layer["size"]) for layer in doc["layers"])
        return digest, size

    def _manifest(self, registry_url: str, path: str, reference: str) -> tuple[dict, str]:
        import requests

        url = f"{registry_url}/v2/{path}/manifests/{reference}"
        headers = {"Accept": MANIFEST_ACCEPT}
        try:
            answer = self.http.get(url, headers=headers, timeout=self.timeout)
            challenge = answer.headers.get("WWW-Authenticate", "")
            if answer.status_code == 401 and challenge.lower().startswith("bearer "):
                params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
                realm = params.pop("realm", "")
                got = self.http.get(realm + "?" + urlencode(params), timeout=self.timeout)
                token = (got.json() if got.ok else {}).get("token") or ""
                answer = self.http.get(url, headers={**headers, "Authorization": f"Bearer {token}"},
                                       timeout=self.timeout)
        except requests.RequestException as exc:
            raise _unreachable(registry_url, exc) from None
        if answer.status_code == 404:
            raise Unresolved(f"{registry_url} has no image {path}:{reference}", "fix `image` (its tag or digest)")
        if answer.status_code in (401, 403):
            raise Unresolved(f"{registry_url} refused to show {path}:{reference} to the controller (HTTP "
                             f"{answer.status_code}, a private registry?)", "pin `image` as name@sha256:<digest>")
        if answer.status_code != 200:
            raise Unresolved(f"{registry_url} answered HTTP {answer.status_code} for {path}:{reference}",
                             "try again, or pin `image` as name@sha256:<digest>")
        digest = answer.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(answer.content).hexdigest()
        return answer.json(), digest


# --- completing the lock -------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """What a host holds from before the lock: its completion markers (repo--name@rev ->
    commit) and the digests of the images it runs by the names tags gave them."""

    markers: dict[str, str] = field(default_factory=dict)
    images: dict[str, list[str]] = field(default_factory=dict)  # local name -> digests

    def of(self, w: Wanted) -> set[str]:
        if w.kind == "model":
            commit = self.markers.get(f"{w.name.replace('/', '--')}@{w.asked.replace('/', '%2F')}")
            return {commit} if commit else set()
        return set(self.images.get(local_image(w.asked), []))


@dataclass(frozen=True)
class Planned:
    lock: FleetLock  # what this run serves and writes
    changes: list[str]  # what moved or entered, one line each (old -> new, sizes)
    problems: list[str]


def plan(settings: dict[str, Settings], lock: FleetLock, update: set[str],
         held: Callable[[list[str]], dict[str, Held]], upstream: Upstream,
         pairs: dict[str, str] | None = None, now: str | None = None) -> Planned:
    """The lock this run uses: ``lock`` with every reference the fleet asks for that it
    lacks resolved (from what the hosts hold, else upstream), and those ``update`` names
    (``all``, ``image``, repo ids) resolved upstream again. ``held(hosts)`` reads what
    hosts hold, asked only when a reference enters the lock; ``pairs`` names each pair
    member's pair, for the messages."""
    now = now or datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    found = wanted(settings)
    tokens = {(s.hf_endpoint or HUB).rstrip("/"): hf_token(s) for s in reversed(settings.values())}
    problems = [f"`fleet_lock_update` names {name}, which no host of the inventory serves (they serve "
                f"{', '.join(sorted({w.name for w in found.values() if w.kind == 'model'})) or 'no repository'}). "
                "Fix: use all, image, or one of those repo ids"
                for name in sorted(update - {"all", "image"} - {w.name for w in found.values()})]
    adopting = [w for k, w in found.items() if w.moving and lock.get(k) is None and not _selected(w, update)]
    holdings = held(sorted({h for w in adopting for h in w.hosts})) if adopting else {}
    entries: list[Entry] = []
    notes: list[str] = []

    def ask(w: Wanted, reference: str) -> tuple[str, int | None]:
        if w.kind == "image":
            return upstream.image(w.where, reference)
        return upstream.model(w.where, w.name, reference, tokens.get(w.where))

    for key, w in found.items():
        old = lock.get(key)
        if old is not None and not (w.moving and _selected(w, update)):
            continue
        if not w.moving:  # a digest or a commit: only its size is asked (once)
            try:
                pin, size = ask(w, w.asked)
            except Unresolved:
                pin, size = w.pinned or "", None
            entries.append(Entry(w.kind, w.name, w.asked, w.pinned or pin, size, now, f"{w.asked} (pinned)"))
            continue
        adopt = old is None and not _selected(w, update)  # a reference moved on purpose takes upstream's
        have = {h: holdings[h].of(w) for h in w.hosts if h in holdings and holdings[h].of(w)} if adopt else {}
        values = set().union(*have.values()) if have else set()
        if len(values) > 1:
            shown = "; ".join(f"{v[:19] if w.kind == 'image' else v[:12]} on "
                              + ", ".join(h + (f" ({pairs[h]})" if pairs and h in pairs else "")
                                          for h, got in have.items() if v in got)
                              for v in sorted(values))
            in_pair = sorted({pairs[h] for h in have if pairs and h in pairs})
            why = (f"; {', '.join(in_pair)} must load the same bytes on every member" if in_pair else "")
            problems.append(
                f"{w.label}: the hosts hold different {'digests' if w.kind == 'image' else 'commits'} of it "
                f"({shown}){why}, and {LOCK_NAME} names none yet. Fix: choose: --data fleet_lock_update={w.name} "
                f"takes what {w.asked} is upstream now, or pin one ("
                + (f"image={w.name}@<digest>" if w.kind == "image" else f"model_revisions={{'{w.name}': '<commit>'}}")
                + ")")
            continue
        try:
            pin, size = ask(w, w.asked)
        except Unresolved as exc:
            if not values:
                problems.append(f"{w.label}: {exc}. Fix: {exc.fix}")
                continue
            pin, size = "", None
        if values:  # held by the fleet from before the lock: kept, so adopting the lock moves nothing
            kept = values.pop()
            if pin and pin != kept:
                notes.append(f"    {w.label}: upstream {w.asked} is {pin[:19] if w.kind == 'image' else pin[:12]} "
                             f"now; --data fleet_lock_update={w.name} moves the fleet to it")
                size = None
            entries.append(Entry(w.kind, w.name, w.asked, kept, size, now,
                                 "held by " + ", ".join(sorted(have))))
        else:
            entries.append(Entry(w.kind, w.name, w.asked, pin, size, now, w.where))
    # What no host asks for any more leaves the lock (as Cargo, Terraform, flake.lock and
    # pip-tools drop what nothing requires); asked for again, it is resolved again.
    new = FleetLock({key: lock.get(key) for key in found if lock.get(key) is not None}).with_entries(entries)
    return Planned(new, changes(lock, new) + notes, problems)


def _selected(w: Wanted, update: set[str]) -> bool:
    return bool(update & {"all", w.name} or ("image" in update and w.kind == "image"))


def size_text(size: int | None) -> str:
    """Bytes as the lock and the deploy show them: GiB, MiB for what is smaller."""
    if size is None:
        return "size unknown"
    return f"{size / GIB:.2f} GiB" if size >= GIB / 10 else f"{size / 2**20:.1f} MiB"


def changes(old: FleetLock, new: FleetLock) -> list[str]:
    """What moved from ``old`` to ``new``, one line each: ``old -> new (sizes)``."""
    lines = [f"    - {entry.label}: {entry.short} (no host asks for it)"
             for key, entry in sorted(old.entries.items()) if key not in new.entries]
    for key, entry in sorted(new.entries.items()):
        before = old.get(key)
        if before is None:
            lines.append(f"    + {entry.label}: {entry.short} ({size_text(entry.size)}, from {entry.source})")
        elif before.pin != entry.pin:
            lines.append(f"    ~ {entry.label}: {before.short} -> {entry.short} "
                         f"({size_text(before.size)} -> {size_text(entry.size)})")
    return lines


# --- the file written when the deploy executes ------------------------------------------------------


@dataclass(frozen=True)
class LockRun:
    """This run's lock: where it lives, what the deploy uses, and the file before."""

    path: Path
    lock: FleetLock
    before: str | None
    changes: list[str]
    writer: str | None  # the host whose operation writes the file (the first one connected)

    @property
    def text(self) -> str:
        return render(self.lock)


def announce(run: LockRun, dry: bool) -> None:
    """Print what the run does to the lock (nothing when it changes nothing)."""
    if run.before is not None and not run.changes:
        return
    verb = "would write" if dry else "writes"
    title = f"{run.path} ({'new, ' if run.before is None else ''}the deploy {verb} it when it runs)"
    logger.info("\n--> Fleet lock: " + title + "\n" + "\n".join(run.changes or ["    (no reference moved)"]) + "\n")


def _write(state, host, path: str, text: str) -> bool:  # pyinfra passes state, host
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)
    return True


@operation()
def written(path: str, text: str, before: str | None, writer: str | None):
    """
    Write sparkfleet.lock on the controller, once for the fleet, when the deploy executes.

    + path: where it lives (``fleet_lock_file``, else beside the inventory)
    + text: the lock this run serves
    + before: the file's text when the deploy planned (None: no file)
    + writer: the host whose run of this operation writes it (the others do nothing)

    Written before any host changes: what the hosts then fetch is what it names, even when
    the deploy stops half-way.
    """
    if host.name != writer:
        host.noop(f"{path} is written by {writer}")
        return
    if text == before:
        host.noop(f"{path} names what the fleet serves")
        return
    yield FunctionCommand(_write, (path, text), {})


def artifacts(lock: FleetLock) -> list[dict[str, Any]]:
    """What the mirror keeps for the lock: one record per entry (kind, name, pin, size)."""
    out = []
    for entry in sorted(lock.entries.values(), key=lambda e: (e.kind, e.key)):
        name = ImageName.parse(entry.name).path if entry.kind == "image" else entry.name
        out.append({"kind": entry.kind, "name": name, "pin": entry.pin, "size": entry.size})
    return out


@deploy("Fleet lock")
def recorded(run: LockRun) -> None:
    """sparkfleet.lock on the controller names what the fleet serves (written once, by one host's turn)."""
    written(name=f"{LOCK_NAME} names what the fleet serves", path=str(run.path), text=run.text,
            before=run.before, writer=run.writer)
