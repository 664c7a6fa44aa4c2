"""sparkfleet.lock as a file: its entries, read, parsed, rendered and diffed.

What the lock is for, and when a run completes or moves it: :mod:`sparkfleet.fleetlock`.
"""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from sparkfleet.config import ConfigError

#: The file's name beside the inventory (or in the current directory, ``fleet_lock_file``).
LOCK_NAME = "sparkfleet.lock"
VERSION = 1
GIB = 1024**3
#: A commit as the hub names it (a digest is sha256:<64 hex>).
COMMIT = re.compile(r"^[0-9a-f]{40}$")
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
        return short_pin(self.kind, self.pin)


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
            ("image", "reference", "reference", "digest", _DIGEST), ("model", "repo", "revision", "commit", COMMIT)):
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


# --- what moved, as the deploy shows it -----------------------------------------------------------


def short_pin(kind: str, pin: str) -> str:
    """A pin as the deploy shows it: a digest's ``sha256:`` and 12 hex, a commit's 12."""
    return pin[:19] if kind == "image" else pin[:12]


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

