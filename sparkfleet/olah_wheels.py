"""The wheel set of the HF mirror (``mirror_olah``) for the mirror host's Python.

olah 0.5.4 requires ``fastapi-utils``, and every fastapi-utils release pins ``psutil<6``;
psutil 5.x has no Linux aarch64 wheels, so on DGX OS (aarch64, CPython 3.12) pip cannot
resolve olah from wheels at all. olah imports only ``fastapi_utils.tasks.repeat_every``,
which needs neither psutil nor anything olah does not already require. So the packages
in ``WITHOUT_DEPS`` are taken as they are (the real wheel, no copied code) but without
their own dependencies, and everything else resolves normally. The host then installs
the whole set with ``pip install --no-deps``: the set is the closure.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

#: Packages whose own dependencies are not installed, each with the reason.
WITHOUT_DEPS = {
    "fastapi-utils": "pins psutil<6 (no Linux aarch64 wheels); olah uses only fastapi_utils.tasks",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requires(wheel: Path) -> list[str]:
    """The Requires-Dist of a wheel, without those of extras."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        lines = z.read(meta).decode().splitlines()
    return [
        line.split(":", 1)[1].strip()
        for line in lines
        if line.startswith("Requires-Dist:") and "extra ==" not in line.replace('"', " ").replace("'", " ")
    ]


def requirement_name(requirement: str) -> str:
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if not m:
        raise ValueError(f"not a requirement: {requirement!r}")
    return canonical(m.group(1))


def downloads(pip_download: list[str], requirement: str, dest: Path) -> Iterator[list[str]]:
    """The ``pip download`` command lines that fill *dest* with *requirement*'s wheel set.

    *pip_download* is the argv prefix (``... pip download -d DEST --only-binary ...``).
    A generator: run each command before taking the next, since the second reads the
    requirement's own wheel that the first downloaded.
    """
    yield [*pip_download, "--no-deps", requirement]
    name = requirement_name(requirement)
    wheel = next(w for w in dest.glob("*.whl") if canonical(w.name.split("-")[0]) == name)
    deps = requires(wheel)
    plain = [r for r in deps if requirement_name(r) not in WITHOUT_DEPS]
    bare = [r for r in deps if requirement_name(r) in WITHOUT_DEPS]
    if plain:
        yield [*pip_download, *plain]
    if bare:
        yield [*pip_download, "--no-deps", *bare]
