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


def floors() -> dict[str, int]:
    """{module: floor} from the numbered list under "## Layers" (a floor may wrap lines)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    found, number = {}, 0
    for line in block.splitlines():
        match = re.match(r"^(\d+)\. ", line)
        if match:
            number = int(match.group(1))
        elif not line.startswith("   "):
            continue
        for name in re.findall(r"`([a-z_]+)`", line.split(": ", 1)[0]):
            found[name] = number
    return found


def _floor_of(path: Path, floor: dict[str, int]) -> int:
    return floor["mirror" if path.parent.name == "mirror" else path.stem]


def test_imports_run_one_way_down_the_layers():
    import ast

    floor = floors()
    modules = [p for p in [*ROOT.glob("sparkfleet/*.py"), *ROOT.glob("sparkfleet/mirror/*.py")]
               if p != ROOT / "sparkfleet" / "__init__.py"]
    assert not [p.stem for p in modules if ("mirror" if p.parent.name == "mirror" else p.stem) not in floor]
    upward = []
    for path in modules:
        own = _floor_of(path, floor)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparkfleet"):
                rest = node.module.split(".")[1:]
                for name in ([a.name for a in node.names] if not rest else [rest[0]]):
                    if floor.get(name, 0) > own:
                        upward.append(f"{path.relative_to(ROOT)} imports {name} (floor {floor[name]} > {own})")
    assert not upward
