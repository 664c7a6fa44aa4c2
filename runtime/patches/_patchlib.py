"""Shared plumbing for the runtime patches: find vLLM, find anchors, apply once, write atomically.

Every patch is a small program (``python3 <patch>.py [--vllm-root DIR]``) that edits the
installed vLLM in place before ``vllm serve`` starts. The protocol with ``serve.py``:

* exactly one status line on stdout: ``sparkfleet-patch: <name>: <outcome>: <detail>``
  with outcome one of ``applied``, ``already-applied``, ``not-needed``, ``failed``;
* exit code 0 for the first three, 1 for ``failed`` (2 for a usage error).

stdlib only: it runs with the serving image's interpreter, and in tests without vLLM.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

STATUS_PREFIX = "sparkfleet-patch:"

APPLIED = "applied"
ALREADY = "already-applied"
NOT_NEEDED = "not-needed"
FAILED = "failed"
OUTCOMES = (APPLIED, ALREADY, NOT_NEEDED, FAILED)
EXIT_CODES = {APPLIED: 0, ALREADY: 0, NOT_NEEDED: 0, FAILED: 1}

ENV_VLLM_ROOT = "SPARKFLEET_VLLM_ROOT"


class PatchFailed(Exception):
    """The patch cannot be applied; the message names file, vLLM version and anchor."""


class NotNeeded(Exception):
    """The installed vLLM already behaves correctly (capability gate)."""


@dataclass(frozen=True)
class Vllm:
    """An installed (or extracted) vLLM: ``root/vllm/`` is the package directory."""

    root: Path
    version: str

    def path(self, relpath: str) -> Path:
        """``relpath`` as in the sdist, e.g. ``vllm/v1/core/kv_cache_utils.py``."""
        return self.root / relpath

    def rel(self, path: Path) -> str:
        try:
            return str(path.relative_to(self.root))
        except ValueError:
            return str(path)

    def first_existing(self, relpaths: Sequence[str]) -> Path | None:
        for rel in relpaths:
            p = self.path(rel)
            if p.is_file():
                return p
        return None


_VERSION_RE = re.compile(r"""^\s*(?:__version__\s*=\s*)?version\s*=\s*['"]([^'"]+)['"]""", re.M)


def _read_version(pkg_dir: Path) -> str:
    # vllm/_version.py is generated at build time and present both in wheels and sdists;
    # reading it avoids importing vllm (which drags in torch and takes seconds).
    vfile = pkg_dir / "_version.py"
    if vfile.is_file():
        m = _VERSION_RE.search(vfile.read_text(encoding="utf-8", errors="replace"))
        if m:
            return m.group(1)
    try:
        from importlib.metadata import version

        return version("vllm")
    except Exception:
        return "unknown"


def locate_vllm(root: str | None) -> Vllm:
    """The vLLM to patch: ``root`` (a directory holding ``vllm/``), else
    ``$SPARKFLEET_VLLM_ROOT``, else wherever ``import vllm`` would load it from.
    ``find_spec`` finds the package without executing it, so no torch import."""
    root = root or os.environ.get(ENV_VLLM_ROOT) or None
    if root:
        pkg = Path(root) / "vllm"
        if not pkg.is_dir():
            raise PatchFailed(f"--vllm-root {root}: no vllm/ package directory there")
        return Vllm(Path(root).resolve(), _read_version(pkg))
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchFailed(f"vLLM is not importable by {sys.executable}")
    pkg = Path(list(spec.submodule_search_locations)[0]).resolve()
    return Vllm(pkg.parent, _read_version(pkg))


def sentinel(name: str) -> str:
    """The marker a patched file carries; its presence makes a re-run a no-op."""
    return f"[sparkfleet:{name}]"


# --- locating code -----------------------------------------------------------------


def _find_def(tree: ast.AST, qualname: str) -> ast.AST | None:
    parts = qualname.split(".")

    def walk(node: ast.AST, idx: int) -> ast.AST | None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.name == parts[idx]:
                    if idx == len(parts) - 1:
                        return child
                    found = walk(child, idx + 1)
                    if found is not None:
                        return found
            # Top-level names may sit under `if TYPE_CHECKING:` / try blocks.
            elif isinstance(child, (ast.If, ast.Try)) and idx == 0:
                found = walk(child, idx)
                if found is not None:
                    return found
        return None

    return walk(tree, 0)


def def_span(text: str, qualname: str) -> tuple[int, int] | None:
    """Character span [start, end) of the def/class ``qualname`` (e.g. ``A.f``) in
    ``text``, decorators excluded; None if absent or the file does not parse."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return None
    node = _find_def(tree, qualname)
    if node is None:
        return None
    lines = text.splitlines(keepends=True)
    start = sum(len(line) for line in lines[: node.lineno - 1])
    end = sum(len(line) for line in lines[: node.end_lineno])
    return start, end


def def_source(text: str, qualname: str) -> str | None:
    span = def_span(text, qualname)
    return None if span is None else text[span[0] : span[1]]


def code_uses(text: str, qualname: str, ident: str) -> bool:
    """Whether the *code* (not docstrings or comments) of ``qualname`` uses ``ident`` as
    a name, attribute, keyword argument or string constant (``getattr(x, "ident")``).
    Capability gates use this: docstrings often describe behaviour the code lacks."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return False
    node = _find_def(tree, qualname)
    if node is None:
        return False
    body = list(getattr(node, "body", []))
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
        body = body[1:]  # the docstring
    for stmt in body:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Name) and sub.id == ident:
                return True
            if isinstance(sub, ast.Attribute) and sub.attr == ident:
                return True
            if isinstance(sub, ast.keyword) and sub.arg == ident:
                return True
            if isinstance(sub, ast.Constant) and sub.value == ident:
                return True
    return False


def find_defining_file(vllm: Vllm, relpaths: Sequence[str], qualname: str) -> Path:
    """First of ``relpaths`` that defines ``qualname`` (functions move between files).

    Raises PatchFailed naming the files, the vLLM version and the missing anchor.
    """
    for rel in relpaths:
        p = vllm.path(rel)
        if p.is_file() and def_span(p.read_text(encoding="utf-8"), qualname) is not None:
            return p
    raise PatchFailed(f"none of {', '.join(relpaths)} (vLLM {vllm.version}) defines anchor {qualname}()")


# --- editing -----------------------------------------------------------------------


@dataclass(frozen=True)
class Edit:
    """Replace ``anchor`` (exact text, must occur exactly once inside ``scope`` - a
    def/class qualname - or the whole file) by ``replacement``."""

    label: str
    anchor: str
    replacement: str
    scope: str | None = None


def _anchor_desc(edit: Edit) -> str:
    first = next((ln.strip() for ln in edit.anchor.splitlines() if ln.strip()), "")
    where = f" in {edit.scope}()" if edit.scope else ""
    return f"{edit.label}{where}: {first!r}"


def apply_edits(text: str, edits: Sequence[Edit], where: str) -> str:
    """Apply ``edits`` in order; ``where`` ("<file> (vLLM x.y)") goes into errors."""
    for edit in edits:
        lo, hi = 0, len(text)
        if edit.scope:
            span = def_span(text, edit.scope)
            if span is None:
                raise PatchFailed(f"{where}: missing anchor {edit.scope}() for {_anchor_desc(edit)}")
            lo, hi = span
        region = text[lo:hi]
        count = region.count(edit.anchor)
        if count == 0:
            raise PatchFailed(f"{where}: missing anchor {_anchor_desc(edit)}")
        if count > 1:
            raise PatchFailed(f"{where}: anchor found {count} times, expected once: {_anchor_desc(edit)}")
        text = text[:lo] + region.replace(edit.anchor, edit.replacement, 1) + text[hi:]
    return text


def atomic_write(path: Path, text: str) -> None:
    """Readers see either the old file or the whole new one: write a temp file in the
    same directory (same filesystem), copy the mode, fsync, then ``os.replace``."""
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".sparkfleet-tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def patch_file(
    vllm: Vllm,
    name: str,
    path: Path,
    edits: Sequence[Edit],
    *,
    append: str = "",
    gate: Callable[[str], str | None] | None = None,
) -> tuple[str, str]:
    """Apply one patch to one file. Order: sentinel (already applied) -> capability gate
    (returns a reason when upstream is already correct) -> anchors -> compile -> write."""
    rel = vllm.rel(path)
    where = f"{rel} (vLLM {vllm.version})"
    text = path.read_text(encoding="utf-8")
    if sentinel(name) in text:
        return ALREADY, where
    if gate is not None:
        reason = gate(text)
        if reason:
            return NOT_NEEDED, f"{where}: {reason}"
    new_text = apply_edits(text, edits, where)
    if append:
        new_text = new_text.rstrip("\n") + "\n\n\n" + append.strip("\n") + "\n"
    if sentinel(name) not in new_text:  # programming error in the patch itself
        raise PatchFailed(f"{where}: patch text lacks its sentinel {sentinel(name)}")
    try:
        compile(new_text, str(path), "exec")
    except SyntaxError as exc:  # never leave a broken vLLM behind
        raise PatchFailed(f"{where}: patched text does not compile: {exc}") from exc
    atomic_write(path, new_text)
    return APPLIED, where


# --- the program ------------------------------------------------------------------


def status_line(name: str, outcome: str, detail: str) -> str:
    detail = " ".join(detail.split())  # one line, whatever the message held
    return f"{STATUS_PREFIX} {name}: {outcome}: {detail}"


def parse_status_line(line: str) -> tuple[str, str, str] | None:
    """(name, outcome, detail) from a status line, else None."""
    if not line.startswith(STATUS_PREFIX):
        return None
    parts = line[len(STATUS_PREFIX) :].strip().split(": ", 2)
    if len(parts) < 2 or parts[1] not in OUTCOMES:
        return None
    return parts[0], parts[1], parts[2] if len(parts) > 2 else ""


def run(name: str, apply: Callable[[Vllm], tuple[str, str]], argv: Sequence[str] | None = None) -> int:
    """Entry point of every patch program."""
    parser = argparse.ArgumentParser(prog=f"{name}.py", description=f"sparkfleet vLLM patch {name}")
    parser.add_argument(
        "--vllm-root",
        help=f"directory that holds the vllm/ package (default: ${ENV_VLLM_ROOT}, else import vllm)",
    )
    args = parser.parse_args(argv)
    try:
        vllm = locate_vllm(args.vllm_root)
        outcome, detail = apply(vllm)
    except NotNeeded as exc:
        outcome, detail = NOT_NEEDED, str(exc)
    except PatchFailed as exc:
        outcome, detail = FAILED, str(exc)
    except Exception as exc:  # report, don't traceback: serve.py shows this line
        outcome, detail = FAILED, f"unexpected {type(exc).__name__}: {exc}"
    print(status_line(name, outcome, detail), flush=True)
    return EXIT_CODES[outcome]
