#!/usr/bin/env python3
"""Build the hybrid INT4+FP8 checkpoint: the Intel AutoRound INT4 checkpoint with
every non-expert tensor that the FP8 donor has in FP8 E4M3 swapped in by name
(in practice the shared-expert projections), plus the donor's 128x128 block
scales (`<name>_scale_inv`).

Runs inside the serving image (stdlib only; `huggingface_hub` only when the donor
is a repo id).  Usage:

    build_hybrid.py --int4 DIR --donor DIR_or_repo_id [--donor-revision R] --out DIR [--verify]

Which tensors are swapped is decided by ``hybrid_plan`` (beside this file); here the
plan is written out, published and verified, and the command line is read.

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
import json
import os
import shutil
import sys
import time
from pathlib import Path

try:  # imported as runtime.build_hybrid (controller, tests)
    from . import hybrid_plan as hp
    from . import safetensors_io as stio
except ImportError:  # run as /host/build_hybrid.py: its directory is sys.path[0]
    import hybrid_plan as hp
    import safetensors_io as stio

INFO_KEY = "sparkfleet_hybrid"
INFO_VERSION = 1
# Fault injection for the tests of the atomic-publish guarantee: exit hard after
# writing this many output shards (simulates a kill / power loss mid-build).
_CRASH_ENV = "SF_BUILD_HYBRID_CRASH_AFTER_SHARDS"


# --------------------------------------------------------------------------- output


def info_block(plan: hp.Plan, int4_dir: Path) -> dict:
    donor = plan.donor
    return {
        "version": INFO_VERSION,
        "builder": "sparkfleet runtime/build_hybrid.py",
        "int4": {
            "repo": hp.repo_from_path(int4_dir),
            "revision": hp.revision_from_path(int4_dir),
            "fingerprint": int4_fingerprint(int4_dir),
        },
        "donor": {
            "source": hp.repo_from_path(donor.local_dir) if donor.local_dir else donor.spec,
            "revision": donor.resolved_revision or donor.revision,
            "fingerprint": donor.fingerprint(),
            "shards_read": sorted({Path(s.fp8_path).name for s in plan.swaps.values()}
                                  | {Path(s.scale_path).name for s in plan.swaps.values()}),
        },
        "swapped": len(plan.swaps),
        "swapped_dtype": hp.FP8_DTYPE,
        "weight_block_size": list(plan.block),
        "mtp_tensors_kept": plan.n_mtp(),
    }


def int4_fingerprint(int4_dir: Path) -> str:
    return hp.fingerprint(int4_dir / "config.json", int4_dir / hp.INDEX_NAME)


def copy_aux_files(int4_dir: Path, dst: Path) -> None:
    """Tokenizer, chat template, generation config...: everything but the
    weights, the index and config.json (those are written by us)."""
    for src in sorted(int4_dir.rglob("*")):
        rel = src.relative_to(int4_dir)
        if rel.parts[0] in (".cache", ".git") or src.is_dir():
            continue
        if rel.suffix == ".safetensors" or rel.name in (hp.INDEX_NAME, "config.json"):
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
            hp.log(f"removing stale partial build {p}")
            shutil.rmtree(p, ignore_errors=True)


def existing_info(out: Path) -> dict | None:
    """The info block of a complete output, or None if OUT is not one of ours."""
    try:
        cfg = json.loads((out / "config.json").read_text())
        if not (out / hp.INDEX_NAME).is_file():
            return None
        return cfg.get(INFO_KEY)
    except (OSError, ValueError):
        return None


def same_inputs(info: dict, int4_dir: Path, donor: hp.Donor) -> bool:
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
    return not (donor.revision and hp.HEX40.match(donor.revision)) or d.get("revision") == donor.revision


def build(int4_dir: Path, donor: hp.Donor, out: Path) -> int:
    if out.exists():
        info = existing_info(out)
        if info is None:
            raise hp.BuildError(f"{out} exists and is not a hybrid checkpoint built by this tool")
        if not same_inputs(info, int4_dir, donor):
            hp.log(f"{out} was built from other inputs (int4 {info.get('int4')}, donor {info.get('donor')}); "
                f"remove it or choose another --out")
            return 3
        hp.log(f"{out} is already complete ({info.get('swapped')} tensors swapped); nothing to do")
        return 0

    out.parent.mkdir(parents=True, exist_ok=True)
    clean_stale_partials(out)
    plan = hp.make_plan(int4_dir, donor)
    if not plan.swaps:
        raise hp.BuildError("the donor has no FP8 tensor matching a float tensor of the INT4 checkpoint")
    for name, why in sorted(plan.skipped.items()):
        hp.log(f"not swapped: {name} ({why})")

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
        hp.log(f"wrote {fname} ({i}/{len(plan.shards)})")
        if crash_after and i >= crash_after:
            os._exit(17)

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (partial / hp.INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    copy_aux_files(int4_dir, partial)
    cfg = json.loads((int4_dir / "config.json").read_text())
    cfg[INFO_KEY] = info_block(plan, int4_dir)
    (partial / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    fsync_dir(partial)

    # The single publishing step.  rename(2) of a directory onto a missing path
    # is atomic, so OUT either does not exist or is complete.
    if out.exists():
        shutil.rmtree(partial, ignore_errors=True)
        raise hp.BuildError(f"{out} appeared while building (concurrent build?)")
    try:
        os.rename(partial, out)
    except OSError as exc:  # lost a race with a concurrent build of the same OUT
        shutil.rmtree(partial, ignore_errors=True)
        raise hp.BuildError(f"cannot publish {out}: {exc}") from exc
    fsync_dir(out.parent)
    hp.log(f"done: {len(plan.swaps)} tensors swapped to FP8, {plan.n_mtp()} MTP tensors kept, "
        f"{len(weight_map)} tensors, {total / 2**30:.2f} GiB in {time.monotonic() - t0:.1f}s -> {out}")
    return 0


# --------------------------------------------------------------------------- verify


def verify(int4_dir: Path, donor: hp.Donor, out: Path) -> int:
    def fail(msg: str) -> int:
        print(f"[build_hybrid] VERIFY FAILED: {msg}", flush=True)
        return 1

    if not out.is_dir():
        return fail(f"{out} does not exist")
    plan = hp.make_plan(int4_dir, donor)
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
        wmap = json.loads((out / hp.INDEX_NAME).read_text())["weight_map"]
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
    hp.log(f"verified {checked} tensors ({len(plan.swaps)} swapped) in {out}")
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
            raise hp.BuildError(f"--int4 {int4_dir} is not a directory")
        donor = hp.open_donor(args.donor, args.donor_revision)
        if args.verify:
            return verify(int4_dir, donor, out)
        return build(int4_dir, donor, out)
    except (hp.BuildError, stio.SafetensorsError, OSError) as exc:  # OSError: disk, hub download
        print(f"[build_hybrid] error: {exc}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main())
