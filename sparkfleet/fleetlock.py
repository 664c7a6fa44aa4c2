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
token, :mod:`sparkfleet.upstream`): only when a reference enters the lock or is moved,
never on a deploy that finds the lock complete. The file itself, read, rendered and
diffed: :mod:`sparkfleet.lockfile`.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, deploy, operation

from sparkfleet.config import Settings, hf_token
from sparkfleet.hostpaths import local_image
from sparkfleet.imagename import ImageName, upstream_registry_url
from sparkfleet.lockfile import COMMIT, LOCK_NAME, Entry, FleetLock, Reference, changes, render, short_pin
from sparkfleet.upstream import Unresolved, Upstream

HUB = "https://huggingface.co"


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
        return not COMMIT.match(self.asked)

    @property
    def pinned(self) -> str | None:
        if self.kind == "image":
            return ImageName.parse(self.asked).digest
        return self.asked if COMMIT.match(self.asked) else None


def _hub(settings: Settings) -> str:
    """The hub ``settings`` download from: its ``hf_endpoint``, else Hugging Face's."""
    return (settings.hf_endpoint or HUB).rstrip("/")


def wanted(settings: dict[str, Settings]) -> dict[str, Wanted]:
    """Every reference of the fleet, by key, with the hosts that ask for it (inventory order)."""
    found: dict[str, Wanted] = {}

    def add(w: Wanted) -> None:
        known = found.get(w.key)
        found[w.key] = replace(known, hosts=(*known.hosts, *w.hosts)) if known else w

    for name, s in settings.items():  # a host stopped (serving=false) keeps its references
        add(Wanted("image", s.image, s.image, (name,), upstream_registry_url(s.image, s.image_registry_url)))
        for repo in s.hub_repos:
            add(Wanted("model", repo, s.revision(repo), (name,), _hub(s)))
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
    tokens = {_hub(s): hf_token(s) for s in reversed(settings.values())}
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
            shown = "; ".join(f"{short_pin(w.kind, v)} on "
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
                notes.append(f"    {w.label}: upstream {w.asked} is {short_pin(w.kind, pin)} "
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


# --- the file written when the deploy executes ------------------------------------------------------


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

