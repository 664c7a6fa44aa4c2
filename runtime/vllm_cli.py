"""Does the image's vLLM accept the serving command? Asked of vLLM itself, without a GPU.

``serve.py --check`` runs this inside the pinned image, before the unit or serve.env
change: the argv the wrapper will exec goes through vLLM's own ``vllm serve`` parser
(``make_arg_parser`` on a ``FlexibleArgumentParser``, as vllm/entrypoints/cli/main.py
builds it), vLLM's pre-load checks (``validate_parsed_serve_args``), the parser names it
has registered (``ToolParserManager`` / ``ReasoningParserManager``, what its API server
checks at start) and the import of every ``--middleware``. An unknown flag, a stray
positional, a parser name it does not know: the answer names the serve.env variable
that brought it, so the deploy can name the setting and the fix.

The check runs without a GPU, and vLLM 0.23 cannot build its command line without one:
its ``DeviceConfig`` default asks the platform for a device type, and with no GPU it
finds none ("Failed to infer device type", raised by ``make_arg_parser``). So, for the
check alone, vLLM is given what a GPU gives it, a CUDA platform, through its own
platform-plugin entry point (``check_platform/``, put on ``sys.path`` before vLLM is
imported; the platform parses, it queries no device). Serving never loads it.

Should that platform not take (a vLLM whose plugin interface changed, another platform
plugin in the image) or not stand in for a GPU, or should the image's vLLM load CUDA
libraries as it imports (naming libcuda or NVML), the failure says nothing about the
command: the argument check is skipped with a warning (``checked: False``) and the start
is the first to parse the command. Any other failure to import or build the command line
still refuses it.

A simulated image (sparkfleet's testbed) has no importable vLLM (no torch): it names
the module that defines its engine's command line in ``SPARKFLEET_VLLM_CLI``, which
offers the same five names, so the check and its engine share one definition.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import sys
from pathlib import Path
from types import SimpleNamespace

#: Set in a simulated image: the module that stands in for vLLM's command-line API.
CLI_MODULE_ENV = "SPARKFLEET_VLLM_CLI"

#: What vLLM says when it fails for want of the GPU the check runs without: no device to
#: infer (0.23's DeviceConfig), or CUDA, the driver (libcuda) or NVML not there.
_NO_GPU = re.compile(r"cuda|nvml|nvidia|\bgpu\b|infer device type", re.IGNORECASE)


#: The parse-only CUDA platform: a directory holding a module and the dist-info that
#: declares it in vLLM's ``vllm.platform_plugins`` entry point group.
PLATFORM_DIR = Path(__file__).resolve().parent / "check_platform"
PLATFORM_PLUGIN = "sf_parse_only"
PLATFORM_MODULE = "sf_parse_only_platform"


def _platform_module() -> str:
    platforms = sys.modules.get("vllm.platforms")
    current = getattr(platforms, "_current_platform", None)
    return type(current).__module__ if current is not None else ""


def use_parse_only_platform() -> str | None:
    """Give the image's vLLM the parse-only CUDA platform, before anything imports vLLM's
    command line (its modules take ``current_platform`` as they import). None once vLLM
    has taken it; else why not, with everything undone so vLLM detects its platform as
    it would have (none, without a GPU)."""
    if _platform_module() == PLATFORM_MODULE:
        return None
    where, allowed = str(PLATFORM_DIR), os.environ.get("VLLM_PLUGINS")
    sys.path.insert(0, where)
    if allowed is not None:  # a list of the plugins to load: add this one
        os.environ["VLLM_PLUGINS"] = ",".join([*filter(None, allowed.split(",")), PLATFORM_PLUGIN])
    try:
        import vllm.platforms

        taken = type(vllm.platforms.current_platform)
        if taken.__module__ != PLATFORM_MODULE:
            raise RuntimeError(f"vLLM took the platform {taken.__module__}.{taken.__qualname__}")
        return None
    except Exception as exc:  # noqa: BLE001 - any failure of the plugin is today's warning, not a verdict
        while where in sys.path:
            sys.path.remove(where)
        if allowed is None:
            os.environ.pop("VLLM_PLUGINS", None)
        else:
            os.environ["VLLM_PLUGINS"] = allowed
        sys.modules.pop(PLATFORM_MODULE, None)
        if "vllm.platforms" in sys.modules:
            sys.modules["vllm.platforms"]._current_platform = None  # resolved again, by vLLM alone
        return f"{type(exc).__name__}: {exc}"


def _platform_failed(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception that led to it, came from the parse-only platform
    falling short of a GPU's: raised in vLLM's platform code or this plugin, or naming it."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if "ParseOnlyCuda" in str(current) or isinstance(current, NotImplementedError):
            return True
        tb = current.__traceback__
        while tb is not None:
            path = tb.tb_frame.f_code.co_filename
            if PLATFORM_MODULE in path or f"{os.sep}vllm{os.sep}platforms{os.sep}" in path:
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False


def image_cli():
    """This image's vLLM command-line API: FlexibleArgumentParser, make_arg_parser,
    validate_parsed_serve_args, ToolParserManager, ReasoningParserManager."""
    name = os.environ.get(CLI_MODULE_ENV)
    if name:
        return importlib.import_module(name)
    from vllm.entrypoints.openai.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return SimpleNamespace(
        FlexibleArgumentParser=FlexibleArgumentParser, make_arg_parser=make_arg_parser,
        validate_parsed_serve_args=validate_parsed_serve_args,
        ToolParserManager=ToolParserManager, ReasoningParserManager=ReasoningParserManager,
    )


def _flag(word: str) -> str:
    """A word as vLLM's parser sees it: ``--max_loras=2`` is ``--max-loras``
    (FlexibleArgumentParser rewrites ``_`` to ``-`` before the first dot)."""
    if not word.startswith("--"):
        return word
    head, dot, rest = word.split("=", 1)[0][2:].partition(".")
    return "--" + head.replace("_", "-") + dot + rest


def _source(word: str, parts: list[tuple[str, list[str]]]) -> str | None:
    """The serve.env variable whose words include ``word`` (a flag or a stray argument),
    however the user spelled the flag."""
    for var, words in reversed(parts):  # SF_EXTRA_ARGS, the likeliest, comes last
        if any(w == word or _flag(w) == _flag(word) for w in words):
            return var
    return None


def refused(message: str, parts: list[tuple[str, list[str]]]) -> str | None:
    """The variable an error is about: the first unrecognized word, the flag of ``argument
    --x: ...`` or ``ambiguous option: --x``, else the first flag the message names that
    the command has (vLLM's checks: ``--a requires --b``)."""
    found = re.search(r"unrecognized arguments: (\S+)", message) or re.search(
        r"(?:argument|ambiguous option:) ([^\s:/]+)", message)
    if found:
        return _source(found.group(1), parts)
    return next(filter(None, (_source(flag, parts) for flag in re.findall(r"--[A-Za-z0-9][\w.-]*", message))), None)


def needs_gpu(exc: BaseException) -> bool:
    """Whether ``exc``, or an exception that led to it, is vLLM failing for want of a GPU."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if _NO_GPU.search(f"{type(current).__name__}: {current}"):
            return True
        current = current.__cause__ or current.__context__
    return False


def _unchecked(exc: BaseException, platform: str | None) -> dict:
    """The warning: ``platform`` is why the parse-only platform was not taken, None when
    it was (and fell short of a GPU)."""
    said = " ".join(f"{type(exc).__name__}: {exc}".split())
    why = (f"; the check's parse-only CUDA platform was not taken: {' '.join(platform.split())}"
           if platform else "; not even with the check's parse-only CUDA platform" if platform is None else "")
    return {"ok": True, "checked": False,
            "detail": f"not checked: this vLLM cannot build its command line without a GPU ({said}{why}); "
                      "the start will be the first to parse the command"}


def check(parts: list[tuple[str, list[str]]]) -> dict:
    """{"ok": True, "checked": True}; {"ok": False, "var": the serve.env variable or None,
    "detail": what vLLM said} for ``vllm serve`` with the words of ``parts``
    (serve_args.argv_parts); or, when vLLM cannot build its command line without a GPU,
    {"ok": True, "checked": False, "detail": the warning}."""
    def no(var: str | None, detail: str) -> dict:
        return {"ok": False, "var": var, "detail": detail}

    # A simulated image's command line needs no platform ("" : none asked for).
    platform = "" if os.environ.get(CLI_MODULE_ENV) else use_parse_only_platform()

    def unchecked(exc: BaseException) -> dict | None:
        if needs_gpu(exc) or (platform is None and _platform_failed(exc)):
            return _unchecked(exc, platform)
        return None

    try:
        cli = image_cli()
    except Exception as exc:  # noqa: BLE001 - whatever the image lacks, say it
        if skipped := unchecked(exc):
            return skipped
        return no(None, f"cannot import the image's vLLM command line: {type(exc).__name__}: {exc}")
    top = cli.FlexibleArgumentParser(prog="vllm")
    subparsers = top.add_subparsers(required=False, dest="subparser")
    try:
        cli.make_arg_parser(subparsers.add_parser("serve", usage="vllm serve [model_tag] [options]"))
    except Exception as exc:  # noqa: BLE001 - vLLM's defaults ask the platform for its device
        if skipped := unchecked(exc):
            return skipped
        return no(None, f"the image's vLLM cannot build its command line: {type(exc).__name__}: {exc}")
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
            args = top.parse_args(["serve", *(w for _, words in parts for w in words)])
    except Exception as exc:  # noqa: BLE001 - not argparse's refusal (that is SystemExit)
        if skipped := unchecked(exc):
            return skipped
        return no(refused(str(exc), parts), f"{type(exc).__name__}: {exc}")
    except SystemExit as exc:
        lines = [line for line in said.getvalue().splitlines() if line.strip()]
        message = next((line for line in reversed(lines) if "error:" in line), lines[-1] if lines else "")
        message = message.split("error: ", 1)[-1] or f"the parser exited ({exc.code})"
        return no(refused(message, parts), message)
    try:
        cli.validate_parsed_serve_args(args)
    except Exception as exc:  # noqa: BLE001 - vLLM raises TypeError/ValueError here
        if not isinstance(exc, (TypeError, ValueError)) and (skipped := unchecked(exc)):
            return skipped
        return no(refused(str(exc), parts), f"{type(exc).__name__}: {exc}")
    # A parser may come from extra_serve_args too (the last one wins, as in vLLM).
    tools = list(cli.ToolParserManager.list_registered())
    if args.enable_auto_tool_choice and args.tool_call_parser not in tools:
        return no(_source("--tool-call-parser", parts) or "SF_TOOL_CALL_PARSER",
                  f"invalid tool call parser: {args.tool_call_parser} (this vLLM knows {', '.join(tools)})")
    reasoning = list(cli.ReasoningParserManager.list_registered())
    if args.reasoning_parser and args.reasoning_parser not in reasoning:
        return no(_source("--reasoning-parser", parts) or "SF_REASONING_PARSER",
                  f"invalid reasoning parser: {args.reasoning_parser} (this vLLM knows {', '.join(reasoning)})")
    for path in getattr(args, "middleware", None) or []:
        module, _, name = path.rpartition(".")
        try:
            getattr(importlib.import_module(module), name)
        except Exception as exc:  # noqa: BLE001 - vLLM would fail its start the same way
            return no(_source(path, parts), f"--middleware {path} does not import: {type(exc).__name__}: {exc}")
    return {"ok": True, "checked": True}


def image_nccl() -> str:
    """The NCCL version the image's torch bundles ("" when it cannot say): what decides
    whether a pair may capture CUDA graphs across nodes (sparkfleet/patchcheck.py)."""
    name = os.environ.get(CLI_MODULE_ENV)
    try:
        if name:
            return str(getattr(importlib.import_module(name), "NCCL_VERSION", ""))
        import torch

        return ".".join(str(p) for p in torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001 - no torch, no NCCL: the deploy treats it as below any floor
        return ""
