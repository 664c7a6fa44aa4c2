"""The simulated serving image `10.213.0.1:5000/sparkfleet/vllm-sim:0.23.0`.

Built without a docker engine, as three deterministic layers:

1. *base*: a Debian bookworm minbase root with python3 (rootfs.image_recipe), trimmed;
   cached per recipe;
2. *vllm source*: the `vllm` Python package of the real vLLM 0.23.0 (the .py/.json files
   of its PyPI sdist, plus the `_version.py` and dist-info a wheel install has), so that
   the serve wrapper's patches find and edit the real code (runtime/patches locate it
   with `find_spec`, never importing it: torch is not in the image);
3. *app*: Python packages the serving image offers (huggingface_hub, requests,
   prometheus_client and their dependencies) installed offline from wheels the
   controller downloads once, plus the simulated engine (the sparkfleet/testbed/engine
   package, as `sparkfleet_vllm_sim`) run by /usr/local/bin/vllm; cached per input hash.

With an artifact scale S (``up --artifact-scale S``) a fourth layer of seeded random bytes
(incompressible, so its blob is as large as its content) brings the blobs to the real
image's compressed size divided by S (:func:`padded_size`); the image stays the same image.

Layers are tarred in sorted order with fixed mtimes/owners names and gzip mtime 0, and the
manifest is serialised canonically, so the same inputs always give the same digest.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import stat
import tarfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

from . import paths, rootfs
from .proc import TestbedError, log, run

#: Fixed mtime of every file in the image (2024-01-01T00:00:00Z).
EPOCH = 1704067200
CREATED = "2024-01-01T00:00:00Z"
APP_LAYER_VERSION = 1
VLLM_VERSION = "0.23.0"  # the serving image's vLLM (IMAGE_TAG)
VLLM_LAYER_VERSION = 1
PYPI_JSON = "https://pypi.org/pypi/vllm/{version}/json"
PYPI_PROJECT_JSON = "https://pypi.org/pypi/vllm/json"

#: hf_xet is named so that it is there whatever pip's markers decide: with it, huggingface_hub
#: downloads Xet files from the CAS (as in a current serving image) unless HF_HUB_DISABLE_XET=1.
PIP_PINS = ["huggingface_hub==2.4.0", "hf_xet==1.8.0", "requests==2.34.2", "prometheus_client==0.26.0"]
PIP_PLATFORMS = [
    "manylinux2014_x86_64", "manylinux_2_17_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_36_x86_64",
]
IMAGE_PYTHON = "3.11"  # bookworm's python3

ENGINE_SRC = Path(__file__).resolve().parent / "engine"
STARTUP_FIGURES = Path(__file__).resolve().parents[2] / "runtime" / "startup.py"
# The engine package's name in the image (not `vllm`: the real vLLM source sits there).
ENGINE_PACKAGE = "sparkfleet_vllm_sim"
ENGINE_LAUNCHER = f"""#!/usr/bin/python3
import sys
from {ENGINE_PACKAGE}.serve import main
sys.exit(main())
""".encode()

IMAGE_ENV = [
    "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "LANG=C.UTF-8",
    "PYTHONUNBUFFERED=1",
    # Its vLLM is not importable (no torch): the serving command's check
    # (runtime/vllm_cli.py) asks the engine's own command line instead.
    f"SPARKFLEET_VLLM_CLI={ENGINE_PACKAGE}.flags",
    # No torch either: the link check's all_gather (runtime/linkcheck.py) asks the NCCL stand-in.
    f"SPARKFLEET_NCCL_STANDIN={ENGINE_PACKAGE}.nccl",
]
#: The default command is `vllm serve` (like the vllm-openai images) but as CMD, not
#: ENTRYPOINT, so both `docker run IMAGE true` and the deploy's
#: `docker run --entrypoint python3 IMAGE /host/serve.py` do what they say.
CMD = ["vllm", "serve"]

#: Contents of these directories are not part of an image (docker mounts its own).
BASE_EMPTY_DIRS = ("dev", "proc", "sys", "run", "tmp", "var/tmp")


@dataclass
class Layer:
    path: str
    digest: str       # sha256 of the gzip blob
    diff_id: str      # sha256 of the uncompressed tar
    size: int         # blob bytes
    uncompressed: int # tar bytes

    @property
    def blob(self) -> Path:
        return Path(self.path)


class _Hashing:
    """File-like writer that hashes and counts what passes through."""

    def __init__(self, out):
        self.out = out
        self.h = hashlib.sha256()
        self.n = 0

    def write(self, b) -> int:
        self.h.update(b)
        self.n += len(b)
        self.out.write(b)
        return len(b)

    def flush(self) -> None:
        self.out.flush()


def _entries(root: Path, skip_contents: Iterable[str] = (), skip: Iterable[str] = ()) -> list[str]:
    """Relative paths under *root*, sorted depth-first (parents before children, names
    in byte order), not descending into symlinks."""
    skip_contents, skip = set(skip_contents), set(skip)
    out: list[str] = []

    def walk(rel: str) -> None:
        full = root / rel if rel else root
        for name in sorted(os.listdir(full)):
            r = f"{rel}/{name}" if rel else name
            if r in skip:
                continue
            out.append(r)
            p = root / r
            if p.is_dir() and not p.is_symlink() and r not in skip_contents:
                walk(r)

    walk("")
    return out


def write_layer(root: Path, out: Path, *, skip_contents: Iterable[str] = (), skip: Iterable[str] = (),
                compresslevel: int = 6) -> Layer:
    """Tar *root* deterministically into gzip blob *out* (written via a temp file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp-{os.getpid()}")
    with open(tmp, "wb") as raw:
        zhash = _Hashing(raw)
        with gzip.GzipFile(filename="", mode="wb", fileobj=zhash, mtime=0, compresslevel=compresslevel) as gz:
            thash = _Hashing(gz)
            with tarfile.open(fileobj=thash, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                for rel in _entries(root, skip_contents, skip):
                    full = root / rel
                    mode = full.lstat().st_mode
                    if stat.S_ISSOCK(mode) or stat.S_ISFIFO(mode) or stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
                        continue
                    ti = tar.gettarinfo(str(full), arcname=rel)
                    ti.mtime = EPOCH
                    ti.uname = ti.gname = ""
                    ti.pax_headers = {}
                    if ti.isreg():
                        with open(full, "rb") as f:
                            tar.addfile(ti, f)
                    else:
                        tar.addfile(ti)
    os.replace(tmp, out)
    return Layer(str(out), "sha256:" + zhash.h.hexdigest(), "sha256:" + thash.h.hexdigest(), zhash.n, thash.n)


def _cached_layer(meta: Path) -> Layer | None:
    try:
        layer = Layer(**json.loads(meta.read_text()))
    except (OSError, ValueError, TypeError):
        return None
    if not layer.blob.exists() or layer.blob.stat().st_size != layer.size:
        return None
    return layer


def base_layer() -> Layer:
    recipe = rootfs.image_recipe()
    key = rootfs.recipe_hash(recipe)
    meta = paths.CACHE_DIR / f"image-base-{key}.json"
    layer = _cached_layer(meta)
    if layer:
        return layer
    root = rootfs.ensure_rootfs(recipe)
    log("writing the image base layer (once)")
    layer = write_layer(root, paths.CACHE_DIR / f"image-base-{key}.tar.gz",
                        skip_contents=BASE_EMPTY_DIRS, skip={".sparkfleet-recipe.json"})
    meta.write_text(json.dumps(asdict(layer), indent=2))
    return layer


def ensure_vllm_sdist(version: str = VLLM_VERSION) -> Path:
    """The PyPI sdist of vLLM *version* (sha256-checked), downloaded once into the cache."""
    import requests

    dest = paths.CACHE_DIR / f"vllm-{version}.tar.gz"
    if dest.exists():
        return dest
    log(f"downloading the vLLM {version} sdist from PyPI (once, ~37 MB)")
    from urllib.parse import urljoin

    def sdist_of(url: str, pick) -> dict | None:
        r = requests.get(url, timeout=60)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        f = next((f for f in pick(r.json()) if f.get("packagetype") == "sdist"), None)
        return {**f, "url": urljoin(url, f["url"])} if f else None

    try:
        # The per-release JSON first; some mirrors only serve the project JSON.
        sdist = (sdist_of(PYPI_JSON.format(version=version), lambda d: d.get("urls", []))
                 or sdist_of(PYPI_PROJECT_JSON, lambda d: d.get("releases", {}).get(version, [])))
        if not sdist:
            raise TestbedError(f"vLLM {version} has no sdist on PyPI")
        tmp = dest.with_name(dest.name + f".tmp-{os.getpid()}")
        h = hashlib.sha256()
        with requests.get(sdist["url"], stream=True, timeout=60) as r, open(tmp, "wb") as out:
            r.raise_for_status()
            for chunk in r.iter_content(1 << 20):
                h.update(chunk)
                out.write(chunk)
    except (requests.RequestException, KeyError, ValueError) as exc:
        raise TestbedError(f"cannot fetch the vLLM {version} sdist from PyPI: {exc}") from exc
    if h.hexdigest() != sdist["digests"]["sha256"]:
        tmp.unlink(missing_ok=True)
        raise TestbedError(f"vLLM sdist sha256 mismatch: {h.hexdigest()} != {sdist['digests']['sha256']}")
    os.replace(tmp, dest)
    return dest


def vllm_layer() -> Layer:
    """Layer with dist-packages/vllm (real source) and its dist-info."""
    sdist = ensure_vllm_sdist()
    key = hashlib.sha256(json.dumps([VLLM_LAYER_VERSION, VLLM_VERSION, sdist.stat().st_size]).encode()).hexdigest()[:16]
    meta = paths.CACHE_DIR / f"image-vllm-{key}.json"
    layer = _cached_layer(meta)
    if layer:
        return layer
    stage = paths.CACHE_DIR / f"image-vllm-stage.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    site = stage / f"usr/local/lib/python{IMAGE_PYTHON}/dist-packages"
    prefix = f"vllm-{VLLM_VERSION}/vllm/"
    try:
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                if not m.isfile() or not m.name.startswith(prefix) or ".." in m.name.split("/"):
                    continue
                out = site / "vllm" / m.name[len(prefix):]
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(m) as src:  # type: ignore[union-attr]
                    out.write_bytes(src.read())
        # What a wheel install adds: the generated version module and the dist-info.
        (site / "vllm/_version.py").write_text(
            f"__version__ = version = {VLLM_VERSION!r}\n__version_tuple__ = version_tuple = "
            f"{tuple(int(x) for x in VLLM_VERSION.split('.'))!r}\n")
        info = site / f"vllm-{VLLM_VERSION}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {VLLM_VERSION}\n"
                                       "Summary: vLLM source only (sparkfleet testbed sim image)\n")
        (info / "INSTALLER").write_text("sparkfleet-testbed\n")
        (info / "top_level.txt").write_text("vllm\n")
        for p in [stage, *stage.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        layer = write_layer(stage, paths.CACHE_DIR / f"image-vllm-{key}.tar.gz")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    meta.write_text(json.dumps(asdict(layer), indent=2))
    return layer


def ensure_wheels() -> Path:
    """Wheels for PIP_PINS (+ deps) for the image's CPython/platform, downloaded once."""
    key = hashlib.sha256(json.dumps([PIP_PINS, PIP_PLATFORMS, IMAGE_PYTHON]).encode()).hexdigest()[:16]
    final = paths.CACHE_DIR / f"wheels-{key}"
    if (final / ".complete").exists():
        return final
    tmp = final.with_name(final.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    log("downloading wheels for the serving image (once)")
    plats = [a for p in PIP_PLATFORMS for a in ("--platform", p)]
    run(["python3", "-m", "pip", "download", "-q", "--only-binary=:all:",
         "--python-version", IMAGE_PYTHON, "--implementation", "cp", "--abi", "cp311", *plats,
         "-d", tmp, *PIP_PINS], timeout=600)
    (tmp / ".complete").write_text("\n".join(PIP_PINS) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    return final


def engine_source() -> dict[str, bytes]:
    """The engine package's files (relative path -> bytes), without caches."""
    files = {str(p.relative_to(ENGINE_SRC)): p.read_bytes() for p in sorted(ENGINE_SRC.glob("*.py"))}
    # The start-up figures the deploy uses too (engine/memory.py imports them from beside it).
    files["startup.py"] = STARTUP_FIGURES.read_bytes()
    if "serve.py" not in files:
        raise TestbedError(f"{ENGINE_SRC} holds no simulated engine (serve.py missing)")
    return files


def app_layer(base: Layer) -> Layer:
    wheels = ensure_wheels()
    engine = engine_source()
    h = hashlib.sha256()
    h.update(json.dumps([APP_LAYER_VERSION, PIP_PINS, base.diff_id]).encode())
    for w in sorted(wheels.glob("*.whl")):
        h.update(w.name.encode() + hashlib.sha256(w.read_bytes()).digest())
    h.update(ENGINE_LAUNCHER)
    for name, body in engine.items():
        h.update(name.encode() + hashlib.sha256(body).digest())
    key = h.hexdigest()[:16]
    meta = paths.CACHE_DIR / f"image-app-{key}.json"
    layer = _cached_layer(meta)
    if layer:
        return layer
    for old in paths.CACHE_DIR.glob("image-app-*"):  # only the current app layer is kept
        old.unlink(missing_ok=True)
    stage = paths.CACHE_DIR / f"image-app-stage.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        site = stage / f"usr/local/lib/python{IMAGE_PYTHON}/dist-packages"
        plats = [a for p in PIP_PLATFORMS for a in ("--platform", p)]
        # --isolated: only our wheel set, never this machine's pip config or find-links.
        run(["python3", "-m", "pip", "--isolated", "install", "-q", "--no-index", "--find-links", wheels,
             "--only-binary=:all:", "--python-version", IMAGE_PYTHON, "--implementation", "cp",
             "--abi", "cp311", *plats, "--target", site, "--no-compile", "--no-warn-script-location",
             *PIP_PINS], timeout=600)
        # Console scripts carry the controller's interpreter path: useless in the image.
        shutil.rmtree(site / "bin", ignore_errors=True)
        vllm = stage / "usr/local/bin/vllm"
        vllm.parent.mkdir(parents=True, exist_ok=True)
        vllm.write_bytes(ENGINE_LAUNCHER)
        for name, body in engine.items():
            (site / ENGINE_PACKAGE).mkdir(exist_ok=True)
            (site / ENGINE_PACKAGE / name).write_bytes(body)
        for p in [stage, *stage.rglob("*")]:
            if p.is_symlink():
                continue
            p.chmod(0o755 if p.is_dir() or p == vllm else 0o644)
        layer = write_layer(stage, paths.CACHE_DIR / f"image-app-{key}.tar.gz")
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    meta.write_text(json.dumps(asdict(layer), indent=2))
    return layer


#: The real serving image's compressed size (group_data/all.py: ~50 GB unpacked from ~21 GB
#: compressed; image_size_gib 47 / image_unpack_ratio 2.4).
REAL_BLOB_GIB = 47.0 / 2.4
PADDING_FILE = "usr/share/sparkfleet-sim/padding.bin"
PADDING_LAYER_VERSION = 1


def padded_size(artifact_scale: float | None) -> int | None:
    """The blob bytes an image scaled down by *artifact_scale* has (None: not padded)."""
    return round(REAL_BLOB_GIB * 2**30 / artifact_scale) if artifact_scale else None


def padding_layer(size: int) -> Layer:
    """A layer of one file of *size* seeded random bytes; cached per size."""
    import numpy as np

    meta = paths.CACHE_DIR / f"image-padding-v{PADDING_LAYER_VERSION}-{size}.json"
    layer = _cached_layer(meta)
    if layer:
        return layer
    for old in paths.CACHE_DIR.glob("image-padding-*"):  # one size kept at a time
        old.unlink(missing_ok=True)
    stage = paths.CACHE_DIR / f"image-padding-stage.tmp-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    try:
        f = stage / PADDING_FILE
        f.parent.mkdir(parents=True)
        f.write_bytes(np.random.default_rng(PADDING_LAYER_VERSION).bytes(size))
        for p in [stage, *stage.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        # Random bytes do not compress: the fastest level gives the same blob size.
        layer = write_layer(stage, paths.CACHE_DIR / f"image-padding-v{PADDING_LAYER_VERSION}-{size}.tar.gz",
                            compresslevel=1)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    meta.write_text(json.dumps(asdict(layer), indent=2))
    return layer


def config_bytes(layers: list[Layer]) -> bytes:
    doc = {
        "architecture": "amd64",
        "os": "linux",
        "created": CREATED,
        "config": {
            "Env": IMAGE_ENV,
            "Cmd": CMD,
            "WorkingDir": "/",
            "Labels": {"org.opencontainers.image.title": "sparkfleet simulated vLLM 0.23.0 serving image"},
        },
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [
            {"created": CREATED, "created_by": "sparkfleet testbed: debian bookworm minbase + python3"},
            {"created": CREATED, "created_by": f"sparkfleet testbed: vllm {VLLM_VERSION} python source"},
            {"created": CREATED, "created_by": "sparkfleet testbed: python packages + simulated vllm"},
            *([{"created": CREATED, "created_by": "sparkfleet testbed: padding to the real image's size"}]
              if len(layers) > 3 else []),
        ],
    }
    return json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()


def build(blob_bytes: int | None = None) -> tuple[bytes, list[Layer]]:
    """The image's config and layers; with *blob_bytes*, padded to about that many blob
    bytes (a padding layer, when the layers are smaller)."""
    base = base_layer()
    layers = [base, vllm_layer(), app_layer(base)]
    if blob_bytes:
        # ~1 KiB of tar and gzip framing around the padding file.
        missing = blob_bytes - sum(layer.size for layer in layers) - 2048
        if missing > 0:
            layers.append(padding_layer(missing))
        else:
            log(f"image: {sum(layer.size for layer in layers)} blob bytes already, more than {blob_bytes}: not padded")
    return config_bytes(layers), layers


def publish(blob_bytes: int | None = None) -> dict:
    """Build (or reuse) the layers and push the image; {ref, digest, pinned, size_bytes,
    blob_bytes, wire_bytes}. *blob_bytes*: padded to about that size (:func:`build`)."""
    from .registry import RegistryClient, manifest_bytes, push_image

    config, layers = build(blob_bytes)
    client = RegistryClient(f"http://{paths.REGISTRY}")
    digest = push_image(client, paths.IMAGE_REPO, paths.IMAGE_TAG, config,
                        [(layer.blob, layer.digest, layer.size) for layer in layers])
    if not digest.startswith("sha256:"):
        raise TestbedError(f"unexpected digest {digest!r}")
    return {
        "ref": paths.IMAGE_REF,
        "digest": digest,
        "pinned": f"{paths.REGISTRY}/{paths.IMAGE_REPO}:{paths.IMAGE_TAG}@{digest}",
        # What the image takes in docker's data root once pulled (unpacked layers).
        "size_bytes": sum(layer.uncompressed for layer in layers),
        "blob_bytes": sum(layer.size for layer in layers),
        # What a pull moves: manifest, config and layers.
        "wire_bytes": sum(layer.size for layer in layers) + len(config) + len(manifest_bytes(
            config, [(layer.blob, layer.digest, layer.size) for layer in layers])),
    }
