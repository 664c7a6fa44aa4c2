"""What a hybrid build swaps: the plan that runtime/build_hybrid.py writes and verifies.

Reads the Intel AutoRound INT4 checkpoint's index and shard headers and the FP8
donor's (a local directory, or a hub repo fetched shard by shard), and decides
which tensors take the donor's FP8 E4M3 weight and its block scales: every
non-expert, non-MTP float ``.weight`` the donor holds in FP8 with its
``_scale_inv``.  Candidates come from the two indexes alone, so only the donor
shards that hold them are fetched, and no tensor data is read here.

Stdlib only (it runs inside the serving image), like the builder.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

try:  # imported as runtime.hybrid_plan (controller, tests)
    from . import safetensors_io as stio
except ImportError:  # imported by /host/build_hybrid.py: its directory is sys.path[0]
    import safetensors_io as stio

INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = "F8_E4M3"
FLOAT_DTYPES = {"BF16", "F16", "F32"}
SCALE_DTYPES = {"F32", "BF16", "F16"}
DEFAULT_BLOCK = (128, 128)
# A commit id: a revision that pins its content (a branch name does not).
HEX40 = re.compile(r"^[0-9a-f]{40}$")


class BuildError(Exception):
    """Bad input: reported with exit code 2."""


def log(msg: str) -> None:
    """One line of the builder's output: the plan's lines read as the builder's."""
    print(f"[build_hybrid] {msg}", flush=True)


# --------------------------------------------------------------------------- inputs


def is_expert(name: str) -> bool:
    """Routed-expert tensors stay INT4 (`...mlp.experts.<E>...`, also the fused
    `mlp.experts.gate_up_proj` layout).  The shared expert is `mlp.shared_expert.`."""
    return ".mlp.experts." in name


def is_mtp(name: str) -> bool:
    # MTP tensors are kept as they are in the INT4 checkpoint: the reference recipe's builder
    # dropped them (breaking the `mtp` profile on the hybrid), and swapping them
    # would need an FP8 dispatch for the MTP module that the serve patch lacks.
    return name.startswith("mtp.")


def revision_from_path(p: Path) -> str | None:
    """A HF cache snapshot dir is .../snapshots/<commit>; report that commit."""
    for part in (p.name, p.parent.name):
        if HEX40.match(part):
            return part
    return None


def repo_from_path(p: Path) -> str | None:
    """`.../models--org--name/snapshots/<commit>` (the HF cache layout) -> org/name."""
    if p.parent.name == "snapshots" and p.parent.parent.name.startswith("models--"):
        return p.parent.parent.name[len("models--"):].replace("--", "/", 1)
    return None


def fingerprint(*files: Path) -> str:
    """Identity of an input checkpoint from its small metadata files.  Paths and
    times are deliberately left out so the output (and its hash) is reproducible."""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(f.read_bytes() if f.is_file() else b"<missing>")
    return h.hexdigest()


@dataclass
class Donor:
    """The FP8 donor: a local directory, or a hub repo fetched shard by shard."""

    spec: str
    revision: str | None
    local_dir: Path | None = None
    resolved_revision: str | None = None
    fetched: list[str] = field(default_factory=list)
    _weight_map: dict[str, str] | None = None
    _config: dict | None = None

    @property
    def is_local(self) -> bool:
        return self.local_dir is not None

    def _hub_file(self, filename: str) -> Path:
        try:
            from huggingface_hub import hf_hub_download
        except ImportError as exc:  # pragma: no cover - depends on the image
            raise BuildError(
                f"donor {self.spec!r} is not a local directory and huggingface_hub is not installed"
            ) from exc
        path = Path(hf_hub_download(repo_id=self.spec, filename=filename, revision=self.revision))
        rev = revision_from_path(path.parent)
        if rev:
            self.resolved_revision = rev
        return path

    def file(self, filename: str) -> Path:
        if self.local_dir is not None:
            p = self.local_dir / filename
            if not p.is_file():
                raise BuildError(f"donor file missing: {p}")
            return p
        p = self._hub_file(filename)
        if filename.endswith(".safetensors") and filename not in self.fetched:
            self.fetched.append(filename)
        return p

    def weight_map(self) -> dict[str, str]:
        if self._weight_map is None:
            if self.local_dir is not None:
                self._weight_map, _ = stio.load_index(self.local_dir)
            else:
                try:
                    idx = self.file(INDEX_NAME)
                except Exception as exc:  # single-file donors are not a thing at 122B
                    raise BuildError(f"cannot fetch {INDEX_NAME} of {self.spec}: {exc}") from exc
                self._weight_map = dict(json.loads(idx.read_text())["weight_map"])
        return self._weight_map

    def config(self) -> dict:
        if self._config is None:
            try:
                self._config = json.loads(self.file("config.json").read_text())
            except (BuildError, OSError, ValueError):
                self._config = {}
        return self._config

    def fingerprint(self) -> str | None:
        # Local donors are identified by their index (paths are not reproducible);
        # hub donors by repo id + commit, so only the index is hashed when local.
        if self.local_dir is None:
            return None
        return fingerprint(self.local_dir / INDEX_NAME)

    def block_size(self) -> tuple[int, int]:
        cfg = self.config()
        qc = cfg.get("quantization_config") or (cfg.get("text_config") or {}).get("quantization_config") or {}
        bs = qc.get("weight_block_size")
        if isinstance(bs, list) and len(bs) == 2:
            return int(bs[0]), int(bs[1])
        return DEFAULT_BLOCK


def open_donor(spec: str, revision: str | None) -> Donor:
    p = Path(spec)
    if p.is_dir():
        return Donor(spec=str(p), revision=revision, local_dir=p, resolved_revision=revision or revision_from_path(p))
    if p.exists() or spec.startswith((".", "/")) or spec.count("/") != 1:
        raise BuildError(f"--donor {spec!r} is neither a directory nor a repo id (org/name)")
    return Donor(spec=spec, revision=revision, resolved_revision=revision if revision and HEX40.match(revision) else None)


# --------------------------------------------------------------------------- plan


@dataclass
class Swap:
    name: str
    orig: stio.TensorInfo
    fp8: stio.TensorInfo
    fp8_path: Path
    scale: stio.TensorInfo
    scale_path: Path


@dataclass
class Plan:
    int4_dir: Path
    shards: dict[str, stio.FileHeader]  # output file name -> input header (same name)
    swaps: dict[str, Swap]
    skipped: dict[str, str]  # name -> why a donor tensor was not swapped
    donor: Donor
    block: tuple[int, int]

    def sources(self, shard: str) -> list[stio.TensorSource]:
        """The output shard's tensors, in the input shard's order; a swapped
        tensor is followed directly by its block scales."""
        hdr = self.shards[shard]
        out: list[stio.TensorSource] = []
        for name, info in hdr.tensors.items():
            sw = self.swaps.get(name)
            if sw is None:
                out.append(stio.TensorSource.from_file(info, hdr.path))
            else:
                out.append(stio.TensorSource.from_file(sw.fp8, sw.fp8_path))
                out.append(stio.TensorSource.from_file(sw.scale, sw.scale_path))
        return out

    def n_mtp(self) -> int:
        return sum(1 for h in self.shards.values() for n in h.tensors if is_mtp(n))


def read_int4(int4_dir: Path) -> dict[str, stio.FileHeader]:
    try:
        weight_map, _ = stio.load_index(int4_dir)
    except FileNotFoundError as exc:
        raise BuildError(str(exc)) from exc
    shards: dict[str, stio.FileHeader] = {}
    for fname in sorted(set(weight_map.values())):
        p = int4_dir / fname
        if not p.is_file():
            raise BuildError(f"index names {fname} but {p} is missing")
        shards[fname] = stio.read_header(p)
    for name, fname in weight_map.items():
        if name not in shards[fname].tensors:
            raise BuildError(f"index maps {name} to {fname}, whose header lacks it")
    return shards


def make_plan(int4_dir: Path, donor: Donor) -> Plan:
    shards = read_int4(int4_dir)
    dmap = donor.weight_map()
    block = donor.block_size()

    # Candidates are decided from the two indexes alone, so only the donor
    # shards that hold them are ever fetched (routed-expert shards never are).
    candidates: dict[str, tuple[stio.TensorInfo, str]] = {}
    for fname, hdr in shards.items():
        for name, info in hdr.tensors.items():
            if is_expert(name) or is_mtp(name) or not name.endswith(".weight"):
                continue
            if name in dmap and name + SCALE_SUFFIX in dmap:
                candidates[name] = (info, fname)
    needed = sorted({dmap[n] for n in candidates} | {dmap[n + SCALE_SUFFIX] for n in candidates})
    log(f"{len(candidates)} candidate tensors; donor shards needed: {len(needed)} of {len(set(dmap.values()))}")
    donor_headers: dict[str, stio.FileHeader] = {}
    for fname in needed:
        donor_headers[fname] = stio.read_header(donor.file(fname))

    swaps: dict[str, Swap] = {}
    skipped: dict[str, str] = {}
    for name, (orig, _fname) in sorted(candidates.items()):
        dh = donor_headers[dmap[name]]
        sh = donor_headers[dmap[name + SCALE_SUFFIX]]
        fp8 = dh.tensors.get(name)
        scale = sh.tensors.get(name + SCALE_SUFFIX)
        if fp8 is None or scale is None:
            raise BuildError(f"donor index lists {name} but its shard header lacks it")
        if fp8.dtype != FP8_DTYPE:
            skipped[name] = f"donor dtype {fp8.dtype}"
            continue
        if orig.dtype not in FLOAT_DTYPES:
            skipped[name] = f"int4 checkpoint holds it as {orig.dtype}, not a float original"
            continue
        if fp8.shape != orig.shape or len(orig.shape) != 2:
            raise BuildError(f"{name}: donor shape {list(fp8.shape)} != original {list(orig.shape)}")
        want = (-(-orig.shape[0] // block[0]), -(-orig.shape[1] // block[1]))
        if scale.shape != want or scale.dtype not in SCALE_DTYPES:
            raise BuildError(
                f"{name}{SCALE_SUFFIX}: {scale.dtype}{list(scale.shape)}, expected float {list(want)} "
                f"for block {list(block)}"
            )
        swaps[name] = Swap(name, orig, fp8, dh.path, scale, sh.path)
    return Plan(int4_dir, shards, swaps, skipped, donor, block)
