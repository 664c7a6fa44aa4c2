#!/usr/bin/env python3
"""Build the hybrid INT4+FP8 checkpoint: the Intel AutoRound INT4 checkpoint with
every non-expert tensor that the FP8 donor has in FP8 E4M3 swapped in by name
(in practice the shared-expert projections), plus the donor's 128x128 block
scales (`<name>_scale_inv`).

Runs inside the serving image (stdlib only; `huggingface_hub` only when the donor
is a repo id).  Usage:

    build_hybrid.py --int4 DIR --donor DIR_or_repo_id [--donor-revision R] --out DIR [--verify]

Guarantees:
* byte-level streaming, shard by shard, through a bounded buffer: memory stays
  at a few tens of MiB whatever the shard size (the contract is "largest output
  shard + 1 GiB");
* only the donor shards that hold the tensors to swap are fetched/read;
* routed experts, MTP tensors (`mtp.*`) and everything else are copied
  bit-identically; `quantization_config` is not touched; an info block
  `sparkfleet_hybrid` is added to config.json; the index is rebuilt from the
  tensors actually written;
* the output is assembled in `OUT.partial-<pid>` and renamed into place at the
  very end, so OUT existing means the build completed; a re-run on a complete
  OUT does nothing;
* `--verify` re-derives the plan from the inputs and compares every output
  tensor byte for byte; exit 1 with the first mismatch.

Exit codes: 0 ok / already complete / verified, 1 verification failed,
2 bad input or usage, 3 OUT exists but was built from other inputs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

try:  # imported as runtime.build_hybrid (controller, tests)
    from . import safetensors_io as stio
except ImportError:  # run as /host/build_hybrid.py: its directory is sys.path[0]
    import safetensors_io as stio

INFO_KEY = "sparkfleet_hybrid"
INFO_VERSION = 1
INDEX_NAME = "model.safetensors.index.json"
SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = "F8_E4M3"
FLOAT_DTYPES = {"BF16", "F16", "F32"}
SCALE_DTYPES = {"F32", "BF16", "F16"}
DEFAULT_BLOCK = (128, 128)
# Fault injection for the tests of the atomic-publish guarantee: exit hard after
# writing this many output shards (simulates a kill / power loss mid-build).
_CRASH_ENV = "SF_BUILD_HYBRID_CRASH_AFTER_SHARDS"
_HEX40 = re.compile(r"^[0-9a-f]{40}$")


class BuildError(Exception):
    """Bad input: reported with exit code 2."""


def log(msg: str) -> None:
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
        if _HEX40.match(part):
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
    return Donor(spec=spec, revision=revision, resolved_revision=revision if revision and _HEX40.match(revision) else None)


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


# --------------------------------------------------------------------------- output


def info_block(plan: Plan, int4_dir: Path) -> dict:
    donor = plan.donor
    return {
        "version": INFO_VERSION,
        "builder": "sparkfleet runtime/build_hybrid.py",
        "int4": {
            "repo": repo_from_path(int4_dir),
            "revision": revision_from_path(int4_dir),
            "fingerprint": int4_fingerprint(int4_dir),
        },
        "donor": {
            "source": repo_from_path(donor.local_dir) if donor.local_dir else donor.spec,
            "revision": donor.resolved_revision or donor.revision,
            "fingerprint": donor.fingerprint(),
            "shards_read": sorted({Path(s.fp8_path).name for s in plan.swaps.values()}
                                  | {Path(s.scale_path).name for s in plan.swaps.values()}),
        },
        "swapped": len(plan.swaps),
        "swapped_dtype": FP8_DTYPE,
        "weight_block_size": list(plan.block),
        "mtp_tensors_kept": plan.n_mtp(),
    }


def int4_fingerprint(int4_dir: Path) -> str:
    return fingerprint(int4_dir / "config.json", int4_dir / INDEX_NAME)


def copy_aux_files(int4_dir: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config...: everything but the
    weights, the index and config.json (those are written by us)."""
    for src in sorted(int4_dir.rglob("*")):
        rel = src.relative_to(int4_dir)
        if rel.parts[0] in (".cache", ".git") or src.is_dir():
            continue
        if rel.suffix == ".safetensors" or rel.name in (INDEX_NAME, "config.json"):
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, dst / rel)  # follows HF-cache symlinks; bounded buffer


def fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def clean_stale_partials(out: Path) -> None:
    for p in out.parent.glob(out.name + ".partial-*"):
        pid_s = p.name.rsplit("-", 1)[-1]
        alive = False
        if pid_s.isdigit() and int(pid_s) != os.getpid():
            try:
                os.kill(int(pid_s), 0)
                alive = True
            except ProcessLookupError:
                alive = False
            except PermissionError:
                alive = True
        if not alive:
            log(f"removing stale partial build {p}")
            shutil.rmtree(p, ignore_errors=True)


def existing_info(out: Path) -> dict | None:
    """The info block of a complete output, or None if OUT is not one of ours."""
    try:
        cfg = json.loads((out / "config.json").read_text())
        if not (out / INDEX_NAME).is_file():
            return None
        return cfg.get(INFO_KEY)
    except (OSError, ValueError):
        return None


def same_inputs(info: dict, int4_dir: Path, donor: Donor) -> bool:
    """Is a complete OUT built from these inputs?  Decided from metadata only,
    so a no-op re-run fetches nothing."""
    if (info.get("int4") or {}).get("fingerprint") != int4_fingerprint(int4_dir):
        return False
    d = info.get("donor") or {}
    if donor.is_local:
        return d.get("fingerprint") == donor.fingerprint()
    if d.get("source") != donor.spec:
        return False
    # A pinned commit must match; a branch name cannot be checked offline.
    return not (donor.revision and _HEX40.match(donor.revision)) or d.get("revision") == donor.revision


def build(int4_dir: Path, donor: Donor, out: Path) -> int:
    if out.exists():
        info = existing_info(out)
        if info is None:
            raise BuildError(f"{out} exists and is not a hybrid checkpoint built by this tool")
        if not same_inputs(info, int4_dir, donor):
            log(f"{out} was built from other inputs (int4 {info.get('int4')}, donor {info.get('donor')}); "
                f"remove it or choose another --out")
            return 3
        log(f"{out} is already complete ({info.get('swapped')} tensors swapped); nothing to do")
        return 0

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(out)
    plan = make_plan(int4_dir, donor)
    if not plan.swaps:
        raise BuildError("the donor has no FP8 tensor matching a float tensor of the INT4 checkpoint")
    for name, why in sorted(plan.skipped.items()):
        log(f"not swapped: {name} ({why})")

    partial = out.parent / f"{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    crash_after = int(os.environ.get(_CRASH_ENV, "0") or 0)

    weight_map: dict[str, str] = {}
    total = 0
    t0 = time.monotonic()
    for i, fname in enumerate(sorted(plan.shards), 1):
        sources = plan.sources(fname)
        meta = plan.shards[fname].metadata or {"format": "pt"}
        stio.write_file(partial / fname, sources, meta)
        for s in sources:
            weight_map[s.name] = fname
            total += s.nbytes
        log(f"wrote {fname} ({i}/{len(plan.shards)})")
        if crash_after and i >= crash_after:
            os._exit(17)

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (partial / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    copy_aux_files(int4_dir, partial)
    cfg = json.loads((int4_dir / "config.json").read_text())
    cfg[INFO_KEY] = info_block(plan, int4_dir)
    (partial / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    fsync_dir(partial)

    # The single publishing step.  rename(2) of a directory onto a missing path
    # is atomic, so OUT either does not exist or is complete.
    if out.exists():
        shutil.rmtree(partial, ignore_errors=True)
        raise BuildError(f"{out} appeared while building (concurrent build?)")
    try:
        os.rename(partial, out)
    except OSError as exc:  # lost a race with a concurrent build of the same OUT
        shutil.rmtree(partial, ignore_errors=True)
        raise BuildError(f"cannot publish {out}: {exc}") from exc
    fsync_dir(out.parent)
    log(f"done: {len(plan.swaps)} tensors swapped to FP8, {plan.n_mtp()} MTP tensors kept, "
        f"{len(weight_map)} tensors, {total / 2**30:.2f} GiB in {time.monotonic() - t0:.1f}s -> {out}")
    return 0


# --------------------------------------------------------------------------- verify


def verify(int4_dir: Path, donor: Donor, out: Path) -> int:
    def fail(msg: str) -> int:
        print(f"[build_hybrid] VERIFY FAILED: {msg}", flush=True)
        return 1

    if not out.is_dir():
        return fail(f"{out} does not exist")
    plan = make_plan(int4_dir, donor)
    try:
        cfg = json.loads((out / "config.json").read_text())
        in_cfg = json.loads((int4_dir / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return fail(f"config.json: {exc}")
    if INFO_KEY not in cfg:
        return fail(f"config.json has no {INFO_KEY} block")
    if cfg.get("quantization_config") != in_cfg.get("quantization_config"):
        return fail("quantization_config differs from the INT4 checkpoint's")
    if cfg[INFO_KEY].get("swapped") != len(plan.swaps):
        return fail(f"info block says {cfg[INFO_KEY].get('swapped')} swapped, inputs give {len(plan.swaps)}")
    try:
        wmap = json.loads((out / INDEX_NAME).read_text())["weight_map"]
    except (OSError, ValueError, KeyError) as exc:
        return fail(f"index: {exc}")

    expected_map: dict[str, str] = {}
    checked = 0
    for fname in sorted(plan.shards):
        sources = plan.sources(fname)
        p = out / fname
        if not p.is_file():
            return fail(f"missing shard {fname}")
        try:
            hdr = stio.read_header(p)
        except stio.SafetensorsError as exc:
            return fail(str(exc))
        if list(hdr.tensors) != [s.name for s in sources]:
            extra = set(hdr.tensors) ^ {s.name for s in sources}
            return fail(f"{fname}: tensor set/order differs (e.g. {sorted(extra)[:3]})")
        for s in sources:
            t = hdr.tensors[s.name]
            if (t.dtype, t.shape) != (s.dtype, s.shape):
                return fail(f"{s.name}: {t.dtype}{list(t.shape)} != expected {s.dtype}{list(s.shape)}")
            assert s.path is not None
            diff = stio.ranges_equal((p, t.start), (s.path, s.offset), s.nbytes)
            if diff is not None:
                return fail(f"{s.name} in {fname}: byte {diff} differs from {s.path}")
            expected_map[s.name] = fname
            checked += 1
    if wmap != expected_map:
        missing = sorted(set(expected_map) - set(wmap))
        extra = sorted(set(wmap) - set(expected_map))
        wrong = sorted(n for n in set(wmap) & set(expected_map) if wmap[n] != expected_map[n])
        return fail(f"index differs: missing {missing[:3]}, extra {extra[:3]}, wrong file {wrong[:3]}")
    log(f"verified {checked} tensors ({len(plan.swaps)} swapped) in {out}")
    return 0


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--int4", required=True, type=Path, help="INT4 AutoRound checkpoint directory")
    ap.add_argument("--donor", required=True, help="FP8 donor directory or hub repo id")
    ap.add_argument("--donor-revision", default=None, help="donor revision (hub only; commit pins it)")
    ap.add_argument("--out", required=True, type=Path, help="output directory (must not be inside the inputs)")
    ap.add_argument("--verify", action="store_true", help="check an existing OUT against the inputs")
    args = ap.parse_args(argv)
    int4_dir = args.int4.absolute()
    out = args.out.absolute()
    try:
        if not int4_dir.is_dir():
            raise BuildError(f"--int4 {int4_dir} is not a directory")
        donor = open_donor(args.donor, args.donor_revision)
        if args.verify:
            return verify(int4_dir, donor, out)
        return build(int4_dir, donor, out)
    except (BuildError, stio.SafetensorsError, OSError) as exc:  # OSError: disk, hub download
        print(f"[build_hybrid] error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
