"""Shared plumbing for the runtime patches: find vLLM, find anchors, apply once, write atomically.

Every patch is a small program (``python3 <patch>.py [--vllm-root DIR] [--check]``) that
edits the installed vLLM in place before ``vllm serve`` starts. The protocol with
``serve.py``:

* exactly one status line on stdout: ``sparkfleet-patch: {"name", "outcome", "file",
  "vllm", "detail"}`` (one JSON object), outcome one of

  - ``applied`` (``would-apply`` with ``--check``, which writes nothing): the anchors
    are there and the patched file compiles;
  - ``already-present``: the fix is in this vLLM - ours from an earlier start, or the
    same fix in another form (upstream's, or the image's own edit), recognised by the
    patch's ``present`` check;
  - ``not-needed``: this vLLM does not take the path the patch fixes;
  - ``cannot-apply``: an anchor is missing and the fix is not recognisable either;

* exit code 0 for all but ``cannot-apply`` (1; 2 for a usage error).

stdlib only: it runs with the serving image's interpreter, and in tests without vLLM.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

STATUS_PREFIX = "sparkfleet-patch:"

APPLIED = "applied"
WOULD_APPLY = "would-apply"
ALREADY = "already-present"
NOT_NEEDED = "not-needed"
FAILED = "cannot-apply"
OUTCOMES = (APPLIED, WOULD_APPLY, ALREADY, NOT_NEEDED, FAILED)
EXIT_CODES = {APPLIED: 0, WOULD_APPLY: 0, ALREADY: 0, NOT_NEEDED: 0, FAILED: 1}

ENV_VLLM_ROOT = "SPARKFLEET_VLLM_ROOT"


class PatchFailed(Exception):
    """The patch cannot be applied; the message names file, vLLM version and anchor."""

    def __init__(self, message: str, file: str | None = None):
        super().__init__(message)
        self.file = file


class NotNeeded(Exception):
    """The installed vLLM already behaves correctly (capability gate)."""


@dataclass(frozen=True)
class Vllm:
    """An installed (or extracted) vLLM: ``root/vllm/`` is the package directory."""

    root: Path
    version: str
    check_only: bool = False  # --check: decide everything, write nothing

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
    existing = [rel for rel in relpaths if vllm.path(rel).is_file()]
    raise PatchFailed(
        f"none of {', '.join(relpaths)} (vLLM {vllm.version}) defines anchor {qualname}()",
        file=(existing or list(relpaths))[0],
    )


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


@dataclass(frozen=True)
class Verdict:
    """What a patch found: its outcome, the file it decided on, and why."""

    outcome: str
    detail: str
    file: str | None = None


# A check that reads a file's text and returns a reason when it holds (else None).
Check = Callable[[str], "str | None"]


def patch_file(
    vllm: Vllm,
    name: str,
    path: Path,
    edits: Sequence[Edit],
    *,
    append: str = "",
    gate: Check | None = None,
    present: Check | None = None,
) -> Verdict:
    """Apply one patch to one file. Order: our sentinel (already present) -> ``present``
    (the same fix in another form: upstream's or the image's own edit; returns a reason)
    -> ``gate`` (this vLLM does not take the path; returns a reason) -> anchors ->
    compile -> write (with ``vllm.check_only``: stop before writing)."""
    rel = vllm.rel(path)
    where = f"{rel} (vLLM {vllm.version})"
    text = path.read_text(encoding="utf-8")
    if sentinel(name) in text:
        return Verdict(ALREADY, f"{where}: applied by sparkfleet at an earlier start", rel)
    if present is not None:
        reason = present(text)
        if reason:
            return Verdict(ALREADY, f"{where}: {reason}", rel)
    if gate is not None:
        reason = gate(text)
        if reason:
            return Verdict(NOT_NEEDED, f"{where}: {reason}", rel)
    try:
        new_text = apply_edits(text, edits, where)
    except PatchFailed as exc:
        raise PatchFailed(str(exc), file=rel) from None
    if append:
        new_text = new_text.rstrip("\n") + "\n\n\n" + append.strip("\n") + "\n"
    if sentinel(name) not in new_text:  # programming error in the patch itself
        raise PatchFailed(f"{where}: patch text lacks its sentinel {sentinel(name)}", file=rel)
    try:
        compile(new_text, str(path), "exec")
    except SyntaxError as exc:  # never leave a broken vLLM behind
        raise PatchFailed(f"{where}: patched text does not compile: {exc}", file=rel) from exc
    if vllm.check_only:
        return Verdict(WOULD_APPLY, where, rel)
    atomic_write(path, new_text)
    return Verdict(APPLIED, where, rel)


# --- the program ------------------------------------------------------------------


def status_line(name: str, verdict: Verdict, version: str | None = None) -> str:
    doc = {
        "name": name,
        "outcome": verdict.outcome,
        "file": verdict.file,
        "vllm": version,
        "detail": " ".join(verdict.detail.split()),  # one line, whatever the message held
    }
    return f"{STATUS_PREFIX} {json.dumps(doc, sort_keys=True)}"


def parse_status_line(line: str) -> dict | None:
    """The status object of a status line (name, outcome, file, vllm, detail), else None."""
    if not line.startswith(STATUS_PREFIX):
        return None
    try:
        doc = json.loads(line[len(STATUS_PREFIX) :])
    except ValueError:
        return None
    if not isinstance(doc, dict) or doc.get("outcome") not in OUTCOMES or not isinstance(doc.get("name"), str):
        return None
    return doc


def run(name: str, apply: Callable[[Vllm], "Verdict | tuple[str, str]"], argv: Sequence[str] | None = None) -> int:
    """Entry point of every patch program."""
    parser = argparse.ArgumentParser(prog=f"{name}.py", description=f"sparkfleet vLLM patch {name}")
    parser.add_argument(
        "--vllm-root",
        help=f"directory that holds the vllm/ package (default: ${ENV_VLLM_ROOT}, else import vllm)",
    )
    parser.add_argument("--check", action="store_true", help="decide what the patch would do; write nothing")
    args = parser.parse_args(argv)
    version = None
    try:
        vllm = locate_vllm(args.vllm_root)
        version = vllm.version
        if args.check:
            vllm = Vllm(vllm.root, vllm.version, check_only=True)
        verdict = apply(vllm)
        if not isinstance(verdict, Verdict):
            verdict = Verdict(*verdict)
    except NotNeeded as exc:
        verdict = Verdict(NOT_NEEDED, str(exc))
    except PatchFailed as exc:
        verdict = Verdict(FAILED, str(exc), exc.file)
    except Exception as exc:  # report, don't traceback: serve.py shows this line
        verdict = Verdict(FAILED, f"unexpected {type(exc).__name__}: {exc}")
    print(status_line(name, verdict, version), flush=True)
    return EXIT_CODES[verdict.outcome]
