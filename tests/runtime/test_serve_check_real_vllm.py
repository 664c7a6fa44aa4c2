"""``serve.py --check`` against an importable vLLM, with no GPU and no network.

The deploy runs the check inside the image with no GPU (sparkfleet/patchcheck.py). vLLM
0.23.0 cannot build its command line there on its own: with no GPU it infers no device
("Failed to infer device type", raised by ``make_arg_parser``). The check gives it the
parse-only CUDA platform (runtime/check_platform/) through vLLM's platform-plugin entry
point; where that does not take, or a vLLM cannot build its command line without a GPU
anyway, the argument check is skipped with a warning, not a refusal of every host. Fake
vllm packages show each way the command line fails; the real vLLM 0.23.0 wheel from
PyPI (tests/support/real_vllm.py, installed as the image keeps it) shows the path the
image takes: the patches against its installed sources, and its parser accepting each
profile's command - or, when the platform does not take, the warning.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support.runtime_env import PROFILES, RUNTIME_DIR, profile_env

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


# --- the real vLLM 0.23.0 -----------------------------------------------------------------


@pytest.fixture(scope="module")
def real_site() -> Path:
    """vLLM 0.23.0 from PyPI, installed as the image keeps it (downloaded once, ~330 MB)."""
    from support.real_vllm import RealVllmError, image_site

    if importlib.util.find_spec("torch") is None:
        pytest.fail("vLLM's command line imports torch, and this interpreter has none: `make deps` installs it")
    try:
        return image_site()
    except RealVllmError as exc:
        failed = str(exc)
    pytest.fail(failed, pytrace=False)  # outside the handler: the message alone, not a chain of two


@pytest.mark.network
def test_the_real_vllm_takes_every_patch_and_checks_the_command(real_site) -> None:
    """The dense profile carries all four patches; each finds its anchors in the installed
    0.23.0 sources, and vLLM's parser, on the parse-only platform, accepts the command."""
    rc, doc, err = run_check(_env("dense", [real_site]))
    assert doc["vllm"] == {"root": str(real_site), "version": "0.23.0"}
    assert {p["name"]: p["verdict"] for p in doc["patches"]} == {
        "kv_unify": "would-apply", "inc_fp8_shared": "would-apply", "int8_lmhead": "would-apply",
        "fla_shmem": "would-apply"}, doc["patches"]
    assert doc["args"]["ok"] is True and doc["args"]["checked"] is True, doc["args"]
    assert "Platform plugin sf_parse_only is activated" in err
    assert "warning: serving command not checked" not in err
    assert rc == 0 and doc["ok"] is True and problems(doc, "img", [p["name"] for p in doc["patches"]]) == []
    assert args_summary(doc) == "vLLM accepts the command"


_ASK_EACH = textwrap.dedent("""\
    import json, sys
    import serve_args, vllm_cli
    envs = json.load(sys.stdin)
    print(json.dumps({name: vllm_cli.check(serve_args.argv_parts(env)) for name, env in envs.items()}))
    """)


@pytest.mark.network
def test_the_real_vllm_parser_accepts_every_profile_and_refuses_a_stray_flag(real_site) -> None:
    envs = {profile: profile_env(profile) for profile in PROFILES}
    envs["stray-flag"] = {**envs["dflash"], "SF_EXTRA_ARGS": json.dumps(["--no-such-flag"])}
    proc = subprocess.run([sys.executable, "-c", _ASK_EACH], input=json.dumps(envs), capture_output=True, text=True,
                          env=_env("dflash", [real_site, RUNTIME_DIR]), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    said = json.loads(proc.stdout.splitlines()[-1])
    for profile in PROFILES:
        assert said[profile] == {"ok": True, "checked": True}, (profile, said[profile])
    assert said["stray-flag"]["ok"] is False and said["stray-flag"]["var"] == "SF_EXTRA_ARGS", said["stray-flag"]
    assert "unrecognized arguments: --no-such-flag" in said["stray-flag"]["detail"]


# Another platform plugin beside the check's: vLLM activates one only, so the check's does
# not take. This one stands aside once the check's is gone, leaving vLLM no platform.
_OTHER = ("import sys\ndef register():\n"
          "    return 'vllm.platforms.cpu.CpuPlatform' if 'sf_parse_only_platform' in sys.modules else None\n")


@pytest.mark.network
def test_a_platform_that_does_not_take_leaves_the_warning(real_site, tmp_path) -> None:
    other = tmp_path / "other"
    (other / "other_platform-0.dist-info").mkdir(parents=True)
    (other / "other_platform.py").write_text(_OTHER)
    (other / "other_platform-0.dist-info/METADATA").write_text("Metadata-Version: 2.1\nName: other-platform\nVersion: 0\n")
    (other / "other_platform-0.dist-info/entry_points.txt").write_text(
        "[vllm.platform_plugins]\nother = other_platform:register\n")
    rc, doc, err = run_check(_env("base", [other, real_site], SF_PATCHES=""))
    assert rc == 0 and doc["ok"] is True, doc
    assert doc["args"]["ok"] is True and doc["args"]["checked"] is False, doc["args"]
    detail = doc["args"]["detail"]
    assert "Failed to infer device type" in detail and "parse-only CUDA platform was not taken" in detail, detail
    assert "Only one platform plugin can be activated" in detail, detail
    assert "warning: serving command not checked" in err
