"""The OOM guard's idea of the engine: earlyoom prefers, and its hook ends the serving
container for, vLLM's processes only, by the names (comm) they really have."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from sparkfleet.oomguard import earlyoom_args, engine_names, hook

ENGINE = ["vllm", "VLLM::EngineCor", "VLLM::Worker_TP0", "VLLM::APIServer"]
# olah serves the HF mirror as python3 on the mirror host; the host's own tools are python3 too.
NOT_ENGINE = ["python3", "python3.12", "python", "olah", "sshd", "dockerd", "vllm-tool", "my-vllm", "VLLM", "uvicorn"]


def matches(pattern: str, name: str) -> bool:
    """As earlyoom (POSIX extended regex) and the hook (grep -E) read the pattern."""
    return subprocess.run(["grep", "-Eq", pattern], input=name + "\n", text=True).returncode == 0


def prefer(args: str) -> str:
    words = shlex.split(args)
    return words[words.index("--prefer") + 1]


@pytest.mark.parametrize("name", ENGINE)
def test_the_engines_processes_are_preferred(name):
    assert matches(prefer(earlyoom_args(4.0)), name)


@pytest.mark.parametrize("name", NOT_ENGINE)
def test_no_other_process_is_preferred(name):
    assert not matches(prefer(earlyoom_args(4.0)), name)


def test_the_hook_ends_the_container_for_the_same_names():
    text = hook(4.0)
    assert f"grep -Eq {shlex.quote(engine_names())}" in text and "docker kill" in text


def test_a_prefix_set_in_vllm_env_is_followed_as_comm_cuts_it():
    pattern = engine_names("SPARKFLEETENGINE")  # comm keeps 15 characters
    assert matches(pattern, "SPARKFLEETENGIN") and matches(pattern, "vllm")
    assert not matches(pattern, "VLLM::EngineCor")


def test_the_names_are_what_the_processes_are_called(tmp_path: Path):
    """`vllm serve` is a Python console script (the testbed's engine too): the kernel names
    the process after the script. vLLM's setproctitle names its processes through comm."""
    script = tmp_path / "vllm"
    script.write_text(f"#!{sys.executable}\nprint(open('/proc/self/comm').read().strip())\n")
    script.chmod(0o755)
    engine_core = ("open('/proc/self/comm', 'w').write('VLLM::EngineCore'); "
                   "print(open('/proc/self/comm').read().strip())")
    names = [subprocess.run([str(script)], capture_output=True, text=True).stdout.strip(),
             subprocess.run([sys.executable, "-c", engine_core], capture_output=True, text=True).stdout.strip()]
    assert names == ["vllm", "VLLM::EngineCor"]
    assert all(matches(engine_names(), name) for name in names)
    plain = subprocess.run([sys.executable, "-c", "print(open('/proc/self/comm').read().strip())"],
                           capture_output=True, text=True).stdout.strip()
    assert plain.startswith("python") and not matches(engine_names(), plain)
