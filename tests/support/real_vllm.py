"""The serving image's vLLM, the real PyPI wheel, installed for tests that import it.

``serve.py --check`` imports vLLM's ``vllm serve`` command line inside the image, with
no GPU. To run that path here, the vLLM 0.23.0 wheel is installed (``pip install
--no-deps --target``) into a directory laid out as the image keeps it,
``.../usr/local/lib/python<X.Y>/dist-packages``; a test puts it on ``PYTHONPATH``, which
the image's python3 has on ``sys.path`` by default, so ``import vllm`` and the patches'
``find_spec`` find it as they do in the image.

Only what that import needs is installed beside it (``CLI_DEPS``, found by importing
with nothing else on the path; versions as pip resolves the wheel's requirements).
torch is the interpreter's own (``make deps`` installs it): vLLM pins torch 2.11.0, a
CUDA build of several GB, and its command line needs only torch's Python side.

Once installed, nothing needs the network. Cache layout (``$SPARKFLEET_CACHE`` or
``~/.cache/sparkfleet``, as tests/support/vllm_source.py)::

    vllm/<version>/wheels/          the wheels, downloaded once (~330 MB)
    vllm/<version>/image-<key>/     the install (~770 MB); <key> names the pins and Python
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from support.vllm_source import VLLM_IMAGE_VERSION, cache_root

#: What importing vLLM 0.23.0's command line (vllm_cli.image_cli) and building its parser
#: needs, besides the wheel itself, torch and the standard library.
CLI_DEPS = (
    "aiohappyeyeballs==2.7.1", "aiohttp==3.14.5", "aiosignal==1.4.0", "annotated-doc==0.0.7",
    "annotated-types==0.8.0", "anyio==4.16.0", "attrs==26.1.0", "cachetools==8.0.2", "cbor2==6.3.0",
    "certifi==2026.10.19.post1", "charset-normalizer==3.5.3", "cloudpickle==3.1.3", "fastapi==0.136.3",
    "frozenlist==1.8.0", "gguf==0.19.0", "httpx2==2.16.2", "huggingface-hub==0.36.2", "idna==3.20",
    "msgspec==0.23.0", "multidict==7.2.1", "numpy==2.3.5", "openai==3.57.0", "openai-harmony==0.0.8",
    "packaging==26.4", "partial-json-parser==0.2.1.1.post7", "pillow==13.0.0", "prometheus-client==0.26.0",
    "propcache==0.5.4", "psutil==7.2.2", "py-cpuinfo==9.0.0", "pybase64==1.5.1", "pydantic==2.14.4",
    "pydantic-core==2.50.5", "pyyaml==6.0.4", "pyzmq==27.3.0", "regex==2026.11.19", "requests==2.34.2",
    "safetensors==0.8.0", "sniffio==1.3.1", "starlette==1.10.0", "tokenizers==0.22.2", "tqdm==4.70.1",
    "transformers==4.57.6", "typing-inspection==0.4.5", "urllib3==2.8.0", "uvloop==0.23.0",
    "yarl==1.25.1",
)
PINS = (f"vllm=={VLLM_IMAGE_VERSION}", *CLI_DEPS)
_PIP_TIMEOUT_S = 1800


class RealVllmError(RuntimeError):
    """The wheels could not be downloaded or installed; the message says what to do."""


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          timeout=_PIP_TIMEOUT_S)


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = [line for line in (proc.stdout + proc.stderr).splitlines()
             if line.strip() and not line.startswith("WARNING: Location")]
    return "\n    ".join(lines[-8:])


def wheels() -> Path:
    """The directory holding every pinned wheel, downloaded once from the index pip uses."""
    root = cache_root() / VLLM_IMAGE_VERSION / "wheels"
    stamp = root / ".pins.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == list(PINS):
        return root
    root.mkdir(parents=True, exist_ok=True)
    proc = _pip("download", "-q", "--no-deps", "--only-binary=:all:", "--no-cache-dir", "-d", str(root), *PINS)
    if proc.returncode != 0:
        raise RealVllmError(
            f"cannot download vLLM {VLLM_IMAGE_VERSION} and its command line's dependencies (~330 MB, once) from "
            f"the package index pip is configured with:\n    {_tail(proc)}\nThis test needs them once; then it runs "
            f"offline from {root}. Reach the index (or set PIP_INDEX_URL to a mirror) and run it again.")
    stamp.write_text(json.dumps(list(PINS)))
    return root


def image_site() -> Path:
    """The dist-packages directory holding the installed vLLM (installing it once)."""
    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    key = hashlib.sha256(json.dumps([PINS, python, sysconfig.get_platform()]).encode()).hexdigest()[:12]
    root = cache_root() / VLLM_IMAGE_VERSION / f"image-{key}"
    site = root / f"usr/local/lib/python{python}/dist-packages"
    if (root / ".complete").is_file():
        return site
    found = wheels()
    tmp = root.with_name(f"{root.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = _pip("--isolated", "install", "-q", "--no-deps", "--no-index", "--find-links", str(found),
                "--no-compile", "--no-warn-script-location", "--target",
                str(tmp / site.relative_to(root)), *PINS)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RealVllmError(f"cannot install the vLLM {VLLM_IMAGE_VERSION} wheels from {found}:\n    {_tail(proc)}")
    (tmp / ".complete").write_text("\n".join(PINS) + "\n")
    shutil.rmtree(root, ignore_errors=True)
    try:
        os.rename(tmp, root)
    except OSError:  # another run installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return site

