"""docs/architecture.md draws the layout as it is: every path it names exists, and every
module of sparkfleet's deploy side is named there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def layout_paths() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layout", 1)[1].split("```", 2)[1]
    paths, parent = [], ""
    for line in block.splitlines():
        match = re.match(r"^(\s*)(\S+)\s", line + " ")
        if not match or not re.search(r"[./]", match.group(2)):
            continue
        indent, name = match.groups()
        if indent:
            paths.append(parent + name)
        else:
            paths.append(name)
            parent = name if name.endswith("/") else ""
    return paths


def test_every_path_in_the_layout_exists():
    paths = layout_paths()
    assert "sparkfleet/mirror/server.py" in paths and "deploy.py" in paths
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, missing


def test_every_deploy_side_module_is_in_the_layout():
    named = set(layout_paths())
    modules = [p.relative_to(ROOT).as_posix() for p in [*ROOT.glob("sparkfleet/*.py"), *ROOT.glob("sparkfleet/mirror/*.py")]
               if p.name != "__init__.py"]
    assert not [m for m in modules if m not in named]


def test_files_the_readme_and_the_architecture_name_exist():
    named = set()
    for doc in ("README.md", "docs/architecture.md"):
        named |= set(re.findall(r"`((?:[\w.-]+/)+[\w.-]+\.(?:py|md|j2|toml|sh))`", (ROOT / doc).read_text()))
    assert "tests/e2e/test_mirror_fleet.py" in named
    assert not [p for p in sorted(named) if not (ROOT / p).exists()]
