"""``serve.py --check`` against an importable vLLM, with no GPU and no network.

The deploy runs the check inside the image with no GPU (sparkfleet/patchcheck.py). A
vLLM that cannot build its command line there - vLLM 0.23.0 cannot: with no GPU it
infers no device ("Failed to infer device type", raised by ``make_arg_parser``) - must
skip the argument check with a warning, not refuse every host. Fake vllm packages show
each way that happens.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.runtime_env import RUNTIME_DIR, profile_env

from runtime import vllm_cli
from sparkfleet.patchcheck import args_summary, problems

SERVE = RUNTIME_DIR / "serve.py"


def _env(profile: str, pythonpath: list[Path], **over: str) -> dict[str, str]:
    """The check's environment in the image: serve.env, no GPU, no network."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SF_", "SPARKFLEET_", "VLLM_", "CUDA_", "HF_", "PYTHON"))}
    env.update(profile_env(profile), CUDA_VISIBLE_DEVICES="", HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(map(str, pythonpath)), **over)
    return env


def run_check(env: dict[str, str], timeout: int = 300) -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, str(SERVE), "--check"], env=env, capture_output=True, text=True,
                          timeout=timeout)
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        pytest.fail(f"serve.py --check printed no verdict (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc.returncode, doc, proc.stderr


# --- what counts as "no GPU" ------------------------------------------------------------


@pytest.mark.parametrize(("exc", "no_gpu"), [
    (ImportError("libcuda.so.1: cannot open shared object file: No such file or directory"), True),
    (RuntimeError("Failed to infer device type, please set the environment variable ..."), True),
    (OSError("NVML Shared Library Not Found"), True),
    (RuntimeError("Found no NVIDIA driver on your system"), True),
    (ModuleNotFoundError("No module named 'fastapi'"), False),
    (SyntaxError("invalid syntax"), False),
])
def test_an_error_for_want_of_a_gpu_is_told_from_an_image_defect(exc, no_gpu) -> None:
    assert vllm_cli.needs_gpu(exc) is no_gpu


def test_the_cause_of_an_error_counts() -> None:
    try:
        try:
            raise OSError("libcuda.so.1: cannot open shared object file")
        except OSError as cause:
            raise ImportError("cannot import name '_C' from 'vllm'") from cause
    except ImportError as exc:
        assert vllm_cli.needs_gpu(exc)


# --- fake vLLMs: each way the command line fails ----------------------------------------

_MODULES = {
    "vllm/__init__.py": "",
    "vllm/_version.py": "__version__ = version = '0.23.0'\n",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/openai/__init__.py": "",
    "vllm/reasoning/__init__.py": "class ReasoningParserManager: pass\n",
    "vllm/tool_parsers/__init__.py": "class ToolParserManager: pass\n",
    "vllm/utils/__init__.py": "",
    "vllm/utils/argparse_utils.py": "from argparse import ArgumentParser as FlexibleArgumentParser\n",
}
_CLI_ARGS = {
    # vllm/_C built against the driver API, in a container the driver was not mounted into.
    "libcuda": "raise ImportError('libcuda.so.1: cannot open shared object file: No such file or directory')\n",
    # vLLM 0.23.0's own failure, as make_arg_parser builds its defaults.
    "no-device": textwrap.dedent("""\
        def make_arg_parser(parser):
            raise RuntimeError("Failed to infer device type, please set the environment variable "
                               "`VLLM_LOGGING_LEVEL=DEBUG` to turn on verbose logging to help debug the issue.")
        def validate_parsed_serve_args(args):
            pass
        """),
    # An image missing a package its vLLM needs: a defect of the image, whatever the GPU.
    "broken": "import fastapi_that_is_not_there\n",
}


def fake_vllm(root: Path, how: str) -> Path:
    for rel, text in {**_MODULES, "vllm/entrypoints/openai/cli_args.py": _CLI_ARGS[how]}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


@pytest.mark.parametrize(("how", "said"), [("libcuda", "libcuda.so.1"), ("no-device", "Failed to infer device type")])
def test_a_command_line_that_needs_a_gpu_skips_the_argument_check_with_a_warning(tmp_path, how, said) -> None:
    site = fake_vllm(tmp_path / "site", how)
    rc, doc, err = run_check(_env("base", [site], SF_PATCHES=""))
    assert rc == 0 and doc["ok"] is True, doc
    assert doc["args"]["ok"] is True and doc["args"]["checked"] is False, doc["args"]
    assert said in doc["args"]["detail"] and "without a GPU" in doc["args"]["detail"]
    assert "warning: serving command not checked" in err
    assert problems(doc, "img@sha256:1", []) == []
    assert args_summary(doc).startswith("the serving command was not checked: this vLLM cannot build")


def test_a_command_line_that_fails_otherwise_still_refuses(tmp_path) -> None:
    site = fake_vllm(tmp_path / "site", "broken")
    rc, doc, _ = run_check(_env("base", [site], SF_PATCHES=""))
    assert rc == 1 and doc["ok"] is False and doc["args"]["ok"] is False
    assert "cannot import the image's vLLM command line: ModuleNotFoundError" in doc["args"]["detail"]
    assert "refuses the serving command" in problems(doc, "img@sha256:1", [])[0]


def test_a_checked_command_reads_as_accepted() -> None:
    assert args_summary({"args": {"ok": True, "checked": True}}) == "vLLM accepts the command"
    assert args_summary({"args": {"ok": True}}) == "vLLM accepts the command"  # a verdict cached before
