"""The HF mirror's wheel set (mirror_olah) resolves for a DGX OS host and for the
simulated fleet's, and is complete: the host installs it with --no-deps and no index."""

from __future__ import annotations

import runpy
import zipfile
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename
from packaging.version import Version

from sparkfleet import olah_wheels

ROOT = Path(__file__).resolve().parents[1]
MIRROR_OLAH = runpy.run_path(str(ROOT / "group_data" / "all.py"))["mirror_olah"]

#: DGX OS 7: Ubuntu 24.04 on aarch64 (glibc 2.39), CPython 3.12.
DGX_OS = {"major": 3, "minor": 12, "machine": "aarch64", "glibc": "2.39"}
#: The simulated hosts: Debian bookworm on x86_64 (glibc 2.36), CPython 3.11.
SIM_HOST = {"major": 3, "minor": 11, "machine": "x86_64", "glibc": "2.36"}


def _environment(python: dict) -> dict[str, str]:
    version = f"{python['major']}.{python['minor']}"
    return {"python_version": version, "python_full_version": f"{version}.0", "platform_machine": python["machine"],
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _metadata(wheel: Path) -> tuple[str, Version, list[str]]:
    name, version, _, _ = parse_wheel_filename(wheel.name)
    return canonicalize_name(name), version, olah_wheels.requires(wheel)


def _unsatisfied(house: Path, python: dict) -> list[str]:
    """Requirements of wheels in *house* that no wheel in it satisfies (for *python*)."""
    env = _environment(python)
    have = {name: version for name, version, _ in map(_metadata, house.glob("*.whl"))}
    missing = []
    for wheel in sorted(house.glob("*.whl")):
        name, _, reqs = _metadata(wheel)
        if name in olah_wheels.WITHOUT_DEPS:
            continue
        for text in reqs:
            req = Requirement(text)
            if req.marker and not Marker(str(req.marker)).evaluate(env):
                continue
            got = have.get(canonicalize_name(req.name))
            if got is None or not req.specifier.contains(got, prereleases=True):
                missing.append(f"{wheel.name}: {text} (have {got or 'nothing'})")
    return missing


@pytest.mark.network
@pytest.mark.parametrize("python", [DGX_OS, SIM_HOST], ids=["aarch64-cp312-dgx-os", "x86_64-cp311-simulated-host"])
def test_mirror_wheelhouse_resolves_for_aarch64_and_the_simulated_hosts(python, tmp_path, monkeypatch):
    """Every requirement of the set the mirror host installs has a wheel for that host."""
    from sparkfleet.mirror import hf

    monkeypatch.setattr(hf, "WHEELHOUSE", tmp_path / "wheelhouse")
    house = hf.controller_wheelhouse(MIRROR_OLAH, python)
    names = {name for name, _, _ in map(_metadata, house.glob("*.whl"))}
    assert {"olah", "fastapi-utils", "fastapi", "uvicorn", "pip"} <= names
    assert "psutil" not in names  # only fastapi-utils wants it, and olah never imports that part
    assert _unsatisfied(house, python) == []
    # What olah imports of fastapi-utils reaches no psutil: dropping its dependencies is safe.
    with zipfile.ZipFile(next(house.glob("fastapi_utils-*.whl"))) as z:
        for module in ("fastapi_utils/__init__.py", "fastapi_utils/cbv_base.py", "fastapi_utils/tasks.py"):
            assert b"psutil" not in z.read(module), module
    machine = python["machine"]
    for wheel in house.glob("*.whl"):
        tags = {t.platform for t in parse_wheel_filename(wheel.name)[3]}
        assert tags == {"any"} or any(machine in t for t in tags), wheel.name


def test_requires_skips_extras_and_splits_off_the_bare_packages(tmp_path):
    meta = ("Metadata-Version: 2.1\nName: olah\nVersion: 9\nRequires-Dist: fastapi>=0.141\n"
            "Requires-Dist: fastapi-utils>=0.8\nRequires-Dist: Fastapi_Utils_Extra\n"
            'Requires-Dist: pytest==9; extra == "dev"\nRequires-Dist: tomli; python_version < "3.11"\n')
    wheel = tmp_path / "olah-9-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("olah-9.dist-info/METADATA", meta)
    assert olah_wheels.requires(wheel) == ["fastapi>=0.141", "fastapi-utils>=0.8", "Fastapi_Utils_Extra",
                                           'tomli; python_version < "3.11"']
    steps = olah_wheels.downloads(["pip", "download"], "olah==9", tmp_path)
    assert next(steps) == ["pip", "download", "--no-deps", "olah==9"]
    assert next(steps) == ["pip", "download", "fastapi>=0.141", "Fastapi_Utils_Extra", 'tomli; python_version < "3.11"']
    assert next(steps) == ["pip", "download", "--no-deps", "fastapi-utils>=0.8"]
    assert list(steps) == []
