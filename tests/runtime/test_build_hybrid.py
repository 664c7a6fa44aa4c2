"""Hybrid INT4+FP8 builder on synthetic checkpoints with the real tensor names."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from runtime import build_hybrid
from runtime import safetensors_io as stio
from sparkfleet.testbed import checkpoints as ck

RUNTIME = Path(build_hybrid.__file__).resolve().parent
BUILDER = RUNTIME / "build_hybrid.py"

REV_INTEL = "1" * 40
REV_DONOR = "2" * 40


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ckpt")
    intel = root / "intel" / REV_INTEL
    donor = root / "donor" / REV_DONOR
    intel.mkdir(parents=True)
    donor.mkdir(parents=True)
    ck.write_intel(intel)
    ck.write_donor(donor)
    return intel, donor


def run(int4: Path, donor: Path | str, out: Path, *extra: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BUILDER), "--int4", str(int4), "--donor", str(donor),
                           "--out", str(out), *extra], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def built(inputs, tmp_path_factory) -> Path:
    intel, donor = inputs
    out = tmp_path_factory.mktemp("out") / "hybrid"
    res = run(intel, donor, out)
    assert res.returncode == 0, res.stdout + res.stderr
    return out


def tensors(d: Path) -> dict[str, tuple[str, tuple[int, ...], bytes, str]]:
    """name -> (dtype, shape, raw bytes, file) for every tensor of every shard."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        hdr = stio.read_header(f)
        data = f.read_bytes()
        for name, t in hdr.tensors.items():
            assert name not in out, f"{name} in two files"
            out[name] = (t.dtype, t.shape, data[t.start:t.end], f.name)
    return out


def expected_swaps(intel: dict, donor: dict) -> set[str]:
    """Computed independently of the builder: non-expert, non-MTP float
    `.weight` tensors of the INT4 checkpoint that the donor has in FP8."""
    return {
        n for n, (dt, _, _, _) in intel.items()
        if n.endswith(".weight") and ".mlp.experts." not in n and not n.startswith("mtp.")
        and dt in ("BF16", "F16", "F32") and n in donor and donor[n][0] == "F8_E4M3"
    }


def test_swapped_tensors_are_the_donors_bit_for_bit(inputs, built):
    intel, donor = (tensors(p) for p in inputs)
    out = tensors(built)
    swaps = expected_swaps(intel, donor)
    # in practice: the shared-expert projections, 3 per layer
    assert len(swaps) == 3 * ck.D.layers
    assert all(".mlp.shared_expert." in n for n in swaps)
    for n in swaps:
        assert out[n][0] == "F8_E4M3" and out[n][1] == intel[n][1]  # shape of the BF16 original
        assert out[n][2] == donor[n][2], n
        sc = n + "_scale_inv"
        assert out[sc][:3] == donor[sc][:3], sc
        assert out[sc][3] == out[n][3]  # scale lives next to its weight


def test_every_other_tensor_is_the_int4_checkpoints(inputs, built):
    intel, donor = (tensors(p) for p in inputs)
    out = tensors(built)
    swaps = expected_swaps(intel, donor)
    assert set(out) == set(intel) | {n + "_scale_inv" for n in swaps}
    for n, (dt, shape, data, fname) in intel.items():
        if n in swaps:
            continue
        assert out[n] == (dt, shape, data, fname), n
    # routed experts untouched and still INT4-packed
    assert out["model.language_model.layers.0.mlp.experts.0.gate_proj.qweight"][0] == "I32"
    # donor-FP8 tensors whose INT4 counterpart is quantized are not swapped
    assert "model.language_model.layers.0.linear_attn.in_proj_qkv.weight" not in out


def test_mtp_kept(inputs, built):
    intel = tensors(inputs[0])
    out = tensors(built)
    mtp = {n for n in intel if n.startswith("mtp.")}
    assert len(mtp) > 20
    for n in mtp:
        assert out[n] == intel[n], n
        assert out[n][3] == "model_extra_tensors.safetensors"
    # the donor has the MTP shared expert in FP8; the INT4 checkpoint's BF16 stays
    assert out["mtp.layers.0.mlp.shared_expert.down_proj.weight"][0] == "BF16"


def test_index_lists_exactly_the_written_tensors(built):
    idx = json.loads((built / "model.safetensors.index.json").read_text())
    out = tensors(built)
    assert idx["weight_map"] == {n: v[3] for n, v in out.items()}
    assert idx["metadata"]["total_size"] == sum(len(v[2]) for v in out.values())


def test_config_info_block_and_quantization_config(inputs, built):
    cin = json.loads((inputs[0] / "config.json").read_text())
    cout = json.loads((built / "config.json").read_text())
    assert cout["quantization_config"] == cin["quantization_config"]
    info = cout.pop(build_hybrid.INFO_KEY)
    assert cout == cin  # nothing else changed
    assert info["swapped"] == 3 * ck.D.layers and info["swapped_dtype"] == "F8_E4M3"
    assert info["int4"]["revision"] == REV_INTEL and info["donor"]["revision"] == REV_DONOR
    assert info["mtp_tensors_kept"] > 20
    for f in ("tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (built / f).read_bytes() == (inputs[0] / f).read_bytes()


def digest_tree(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*")) if p.is_file()}


def test_rerun_on_complete_output_does_nothing(inputs, built):
    before = digest_tree(built)
    mtimes = {p: p.stat().st_mtime_ns for p in built.iterdir()}
    res = run(*inputs, built)
    assert res.returncode == 0, res.stderr
    assert "already complete" in res.stdout
    assert digest_tree(built) == before
    assert {p: p.stat().st_mtime_ns for p in built.iterdir()} == mtimes


def test_existing_output_from_other_inputs_is_refused(inputs, built, tmp_path):
    other = tmp_path / "donor2"
    shutil.copytree(inputs[1], other)
    idx = json.loads((other / "model.safetensors.index.json").read_text())
    idx["metadata"]["total_size"] += 1  # a different donor
    (other / "model.safetensors.index.json").write_text(json.dumps(idx))
    res = run(inputs[0], other, built)
    assert res.returncode == 3, res.stdout + res.stderr


def test_interrupted_build_leaves_no_complete_output(inputs, tmp_path):
    out = tmp_path / "hybrid"
    res = run(*inputs, out, env={"SF_BUILD_HYBRID_CRASH_AFTER_SHARDS": "2"})
    assert res.returncode == 17, res.stdout + res.stderr
    assert not out.exists()
    partials = list(tmp_path.glob("hybrid.partial-*"))
    assert len(partials) == 1 and not (partials[0] / "config.json").exists()
    # the next build cleans the dead build's leftovers and completes
    res = run(*inputs, out)
    assert res.returncode == 0, res.stdout + res.stderr
    assert not list(tmp_path.glob("hybrid.partial-*"))
    assert (out / "model.safetensors.index.json").is_file()


def test_verify_passes_and_catches_a_corrupted_byte(inputs, built, tmp_path):
    res = run(*inputs, built, "--verify")
    assert res.returncode == 0, res.stdout + res.stderr
    out = tensors(built)
    for victim in ("model.language_model.layers.2.mlp.shared_expert.up_proj.weight",  # swapped
                   "model.language_model.layers.5.mlp.experts.1.down_proj.qweight",  # kept
                   "mtp.fc.weight"):  # MTP
        copy = tmp_path / f"copy-{victim}"
        shutil.copytree(built, copy)
        f = copy / out[victim][3]
        t = stio.read_header(f).tensors[victim]
        raw = bytearray(f.read_bytes())
        raw[t.start + t.nbytes // 2] ^= 0x01
        f.write_bytes(bytes(raw))
        res = run(*inputs, copy, "--verify")
        assert res.returncode == 1, res.stdout + res.stderr
        assert victim in res.stdout and "VERIFY FAILED" in res.stdout


def test_verify_catches_an_index_that_lies(inputs, built, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    idx = json.loads((copy / "model.safetensors.index.json").read_text())
    idx["weight_map"]["model.language_model.layers.0.mlp.ghost.weight"] = "model-00001-of-00001.safetensors"
    (copy / "model.safetensors.index.json").write_text(json.dumps(idx))
    res = run(*inputs, copy, "--verify")
    assert res.returncode == 1 and "index differs" in res.stdout


def test_hub_donor_fetches_only_needed_shards(inputs, tmp_path, monkeypatch, capsys):
    """With a repo id, files come through hf_hub_download one by one; the
    shards holding only routed experts must never be asked for."""
    intel, donor = inputs
    asked: list[str] = []

    def fake_download(repo_id: str, filename: str, revision: str | None = None, **_: object) -> str:
        assert repo_id == ck.DONOR
        asked.append(filename)
        snap = tmp_path / "hf" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / REV_DONOR
        snap.mkdir(parents=True, exist_ok=True)
        dst = snap / filename
        if not dst.exists():
            shutil.copyfile(donor / filename, dst)
        return str(dst)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    out = tmp_path / "hybrid"
    assert build_hybrid.main(["--int4", str(intel), "--donor", ck.DONOR, "--out", str(out)]) == 0
    donor_map = json.loads((donor / "model.safetensors.index.json").read_text())["weight_map"]
    by_shard: dict[str, set[str]] = {}
    for n, f in donor_map.items():
        by_shard.setdefault(f, set()).add(n)
    expert_only = {f for f, names in by_shard.items() if all(".mlp.experts." in n for n in names)}
    assert expert_only, "synthetic donor should have expert-only shards"
    shards_asked = {f for f in asked if f.endswith(".safetensors")}
    assert not shards_asked & expert_only
    assert len(shards_asked) < len(by_shard)
    info = json.loads((out / "config.json").read_text())[build_hybrid.INFO_KEY]
    assert info["donor"]["source"] == ck.DONOR and info["donor"]["revision"] == REV_DONOR
    assert set(info["donor"]["shards_read"]) == shards_asked
    # same bytes as the build from the local donor directory
    ref = tmp_path / "local"
    assert run(intel, donor, ref).returncode == 0
    assert {k: v for k, v in digest_tree(out).items() if k != "config.json"} == \
        {k: v for k, v in digest_tree(ref).items() if k != "config.json"}


def test_donor_shape_mismatch_is_an_error(inputs, tmp_path):
    intel, donor = inputs
    bad = tmp_path / "donor"
    shutil.copytree(donor, bad)
    name = "model.language_model.layers.1.mlp.shared_expert.gate_proj.weight"
    fname = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    hdr = stio.read_header(bad / fname)
    srcs = []
    for t in hdr.tensors.values():
        s = stio.TensorSource.from_file(t, bad / fname)
        if t.name == name:  # same bytes, transposed shape
            s = stio.TensorSource(s.name, s.dtype, tuple(reversed(s.shape)), s.nbytes, s.path, s.offset)
        srcs.append(s)
    tmp = bad / "tmp.safetensors"
    stio.write_file(tmp, srcs, hdr.metadata)
    os.replace(tmp, bad / fname)
    res = run(intel, bad, tmp_path / "out")
    assert res.returncode == 2 and "shape" in res.stderr
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- memory

BIG = 96 << 20  # one 96 MiB shard


def _big_checkpoints(root: Path) -> tuple[Path, Path]:
    """INT4 checkpoint with one large shard (a big routed-expert tensor plus a
    shared expert) and a donor with the FP8 shared expert."""
    h = 256
    int4, donor = root / "int4", root / "donor"
    int4.mkdir()
    donor.mkdir()
    se = "model.language_model.layers.0.mlp.shared_expert.down_proj.weight"
    big = ("model.language_model.layers.0.mlp.experts.0.gate_proj.qweight", "I32", (BIG // 4 // 1024, 1024),
           bytes(range(256)) * (BIG // 256))
    w = ck.master(se, (h, h))
    ck.write_sharded(int4, [big, (se, "BF16", (h, h), ck.to_bf16(w))], shard_bytes=1 << 40)
    (int4 / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "auto-round"}}))
    q, sc, sshape = ck.fp8_block_quant(w)
    ck.write_sharded(donor, [(se, "F8_E4M3", (h, h), q), (se + "_scale_inv", "F32", sshape, sc)])
    return int4, donor


# Peak RSS of the builder's own process: /proc/self/status VmHWM after
# resetting it (clear_refs 5) once the interpreter is up.  ru_maxrss would
# not do: Linux carries the parent's high-water mark across fork+exec.
PEAK_SCRIPT = r"""
import json, runpy, sys
builder, args = sys.argv[1], sys.argv[2:]
sys.argv = [builder] + args
sys.path.insert(0, builder.rsplit('/', 1)[0])
import argparse, hashlib, shutil, struct  # what the builder imports anyway
import hybrid_plan, safetensors_io

def status(key):
    for line in open('/proc/self/status'):
        if line.startswith(key + ':'):
            return int(line.split()[1])

with open('/proc/self/clear_refs', 'w') as f:
    f.write('5')
base = status('VmRSS')
rc = 0
if args:
    try:
        runpy.run_path(builder, run_name='__main__')
    except SystemExit as e:
        rc = e.code or 0
print(json.dumps({'rc': rc, 'base_kib': base, 'peak_kib': status('VmHWM')}))
"""


def test_peak_memory_is_far_below_the_largest_shard(tmp_path):
    int4, donor = _big_checkpoints(tmp_path)
    largest = max(p.stat().st_size for p in int4.glob("*.safetensors"))
    assert largest >= BIG
    res = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(BUILDER), "--int4", str(int4),
                          "--donor", str(donor), "--out", str(tmp_path / "out")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["rc"] == 0
    grew = (r["peak_kib"] - r["base_kib"]) * 1024
    print(f"builder peak RSS growth {grew / 2**20:.1f} MiB with a {largest / 2**20:.0f} MiB shard")
    # The contract is "largest output shard + 1 GiB", scaled down here to
    # "largest shard + 16 MiB"; streaming through an 8 MiB buffer must in fact
    # stay well under half the shard.
    assert grew <= largest + (16 << 20)
    assert grew <= largest // 2, f"{grew / 2**20:.1f} MiB"
    out_sizes = [p.stat().st_size for p in (tmp_path / "out").glob("*.safetensors")]
    assert max(out_sizes) >= BIG
