"""Real vLLM source files for tests, fetched from PyPI sdists and cached.

Why sdists: they carry the plain ``.py`` files the runtime patches edit, for any
version, without building anything (``pip download`` of an sdist tries to build it,
which fails here). Only the members a test asks for are extracted; both the archive
and the extracted members are cached between runs.

Cache layout (``$SPARKFLEET_CACHE`` or ``~/.cache/sparkfleet``)::

    vllm/<version>/vllm-<version>.tar.gz     the sdist, sha256-checked
    vllm/<version>/members.json              names of all members (relative to the sdist root)
    vllm/<version>/src/<relpath>             extracted members, e.g. src/vllm/v1/core/kv_cache_utils.py
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path
from urllib.parse import urljoin

import requests

# The one place the tested vLLM versions are pinned.
# 0.23.0 is what the default serving image carries; 0.33.0 is the newest 0.33.x on PyPI
# (checked 2026: the index holds exactly 0.23.0 and 0.33.0 in those series).
VLLM_IMAGE_VERSION = "0.23.0"
VLLM_NEWEST_VERSION = "0.33.0"
VLLM_TEST_VERSIONS = (VLLM_IMAGE_VERSION, VLLM_NEWEST_VERSION)

PYPI_JSON_URL = "https://pypi.org/pypi/vllm/{version}/json"
PYPI_PROJECT_JSON_URL = "https://pypi.org/pypi/vllm/json"
_TIMEOUT_S = 60


class VllmSourceError(RuntimeError):
    """The sdist could not be fetched or does not hold the asked member."""


def cache_root() -> Path:
    base = os.environ.get("SPARKFLEET_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "sparkfleet"
    return root / "vllm"


def _version_dir(version: str) -> Path:
    d = cache_root() / version
    d.mkdir(parents=True, exist_ok=True)
    return d


def _atomic_write_from(src_fileobj, dest: Path) -> None:
    """Copy a stream to ``dest`` via a temp file in the same dir, so a crash or a
    concurrent test run never sees a half-written cache entry."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as out:
            shutil.copyfileobj(src_fileobj, out)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; cached sources are plain readable files
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _get_json(url: str) -> dict | None:
    try:
        resp = requests.get(url, timeout=_TIMEOUT_S)
    except requests.RequestException as exc:
        raise VllmSourceError(f"cannot reach PyPI ({url}): {exc}") from exc
    if resp.status_code == 404:
        return None
    resp.raise_for_status()
    return resp.json()


def _pick_sdist(files: list[dict], base_url: str) -> tuple[str, str, str] | None:
    for f in files:
        if f.get("packagetype") == "sdist":
            # Mirrors may hand out relative URLs; resolve against the JSON's address.
            return urljoin(base_url, f["url"]), f["filename"], f["digests"]["sha256"]
    return None


def _sdist_info(version: str) -> tuple[str, str, str]:
    """(url, filename, sha256) of the sdist of exactly ``version``.

    Tries the per-release JSON first (pypi.org), then the project JSON's ``releases``
    map, because some mirrors serve only the latter."""
    url = PYPI_JSON_URL.format(version=version)
    data = _get_json(url)
    if data is not None:
        picked = _pick_sdist(data.get("urls", []), url)
        if picked:
            return picked
    data = _get_json(PYPI_PROJECT_JSON_URL)
    if data is not None:
        files = data.get("releases", {}).get(version)
        if files is None:
            raise VllmSourceError(f"vllm {version} is not on PyPI")
        picked = _pick_sdist(files, PYPI_PROJECT_JSON_URL)
        if picked:
            return picked
    raise VllmSourceError(f"vllm {version} has no sdist on PyPI")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def vllm_sdist(version: str) -> Path:
    """Path of the cached sdist tarball of vLLM ``version``, downloading it once."""
    vdir = _version_dir(version)
    existing = sorted(vdir.glob("vllm-*.tar.gz"))
    if existing:
        return existing[0]
    url, filename, sha256 = _sdist_info(version)
    dest = vdir / filename
    try:
        with requests.get(url, stream=True, timeout=_TIMEOUT_S) as resp:
            resp.raise_for_status()
            resp.raw.decode_content = True
            _atomic_write_from(resp.raw, dest)
    except requests.RequestException as exc:
        raise VllmSourceError(f"download of {url} failed: {exc}") from exc
    got = _sha256(dest)
    if got != sha256:
        dest.unlink(missing_ok=True)
        raise VllmSourceError(f"{filename}: sha256 {got} != PyPI's {sha256}")
    return dest


def _strip_top(name: str) -> str | None:
    """``vllm-0.23.0/vllm/x.py`` -> ``vllm/x.py`` (None for the top dir itself)."""
    parts = name.split("/", 1)
    return parts[1] if len(parts) == 2 and parts[1] else None


def vllm_members(version: str) -> list[str]:
    """All file names in the sdist, relative to its root (cached index)."""
    index = _version_dir(version) / "members.json"
    if index.exists():
        return json.loads(index.read_text())
    names: list[str] = []
    with tarfile.open(vllm_sdist(version), "r:gz") as tf:
        for m in tf:
            rel = _strip_top(m.name)
            if rel and m.isfile():
                names.append(rel)
    fd, tmp = tempfile.mkstemp(dir=index.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(names, fh)
    os.replace(tmp, index)
    return names


def _extract(version: str, relpaths: Iterable[str]) -> None:
    """Extract the wanted members in one streaming pass over the tarball."""
    src = _version_dir(version) / "src"
    wanted = {r for r in relpaths if not (src / r).exists()}
    if not wanted:
        return
    with tarfile.open(vllm_sdist(version), "r:gz") as tf:
        for m in tf:
            rel = _strip_top(m.name)
            if rel in wanted and m.isfile():
                fh = tf.extractfile(m)
                assert fh is not None
                _atomic_write_from(fh, src / rel)
                wanted.discard(rel)
                if not wanted:
                    return
    if wanted:
        raise VllmSourceError(f"vllm {version} sdist has no member(s): {', '.join(sorted(wanted))}")


def vllm_source_file(version: str, relpath: str) -> Path:
    """Cached path of one file of vLLM ``version``'s sdist, e.g.
    ``vllm_source_file("0.23.0", "vllm/v1/core/kv_cache_utils.py")``.

    The returned file is shared cache: copy it before modifying it.
    """
    relpath = relpath.lstrip("/")
    dest = _version_dir(version) / "src" / relpath
    if not dest.exists():
        if relpath not in set(vllm_members(version)):
            raise VllmSourceError(f"vllm {version} sdist has no member {relpath!r}")
        _extract(version, [relpath])
    return dest


def vllm_source_files(version: str, relpaths: Iterable[str]) -> dict[str, Path]:
    """Like ``vllm_source_file`` for many members, extracting the missing ones in a
    single pass over the tarball (one pass per member would rescan it each time)."""
    rels = [r.lstrip("/") for r in relpaths]
    src = _version_dir(version) / "src"
    todo = [r for r in rels if not (src / r).exists()]
    if todo:
        members = set(vllm_members(version))
        absent = [r for r in todo if r not in members]
        if absent:
            raise VllmSourceError(f"vllm {version} sdist has no member(s): {', '.join(absent)}")
        _extract(version, todo)
    return {r: src / r for r in rels}


def vllm_has_file(version: str, relpath: str) -> bool:
    return relpath.lstrip("/") in set(vllm_members(version))


def vllm_source_tree(version: str, relpaths: Iterable[str], dest: Path) -> Path:
    """Copy the given sdist members (those that exist in ``version``) into ``dest``,
    keeping their relative layout, and return ``dest``. Missing members are skipped so
    one list can serve several versions; use it as a writable ``--vllm-root``."""
    members = set(vllm_members(version))
    present = [r.lstrip("/") for r in relpaths if r.lstrip("/") in members]
    _extract(version, present)
    for rel in present:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(vllm_source_file(version, rel), target)
    return dest
