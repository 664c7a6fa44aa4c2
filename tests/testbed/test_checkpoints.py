"""The synthetic checkpoint repos served by the testbed hub."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from runtime import safetensors_io as stio
from sparkfleet.testbed import checkpoints as ck

HEX40 = re.compile(r"^[0-9a-f]{40}$")


@pytest.fixture(scope="module")
def repos(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("hub")
    return root, ck.write_synthetic_repos(root)


def repo_dir(repos, repo: str) -> Path:
    root, revs = repos
    return root / repo / revs[repo]


def headers(d: Path) -> dict[str, tuple[stio.TensorInfo, str]]:
    out = {}
    for f in d.glob("*.safetensors"):
        for n, t in stio.read_header(f).tensors.items():
            out[n] = (t, f.name)
    return out


def test_layout_and_pinned_revisions(repos):
    root, revs = repos
    assert set(revs) == {ck.INTEL, ck.DONOR, ck.HYBRID, ck.DFLASH}
    for repo, rev in revs.items():
        assert HEX40.match(rev), rev
        d = root / repo / rev
        assert (d / "config.json").is_file() and (d / "model.safetensors.index.json").is_file()
        shards = [p.name for p in d.glob("model-*-of-*.safetensors")]
        assert len(shards) >= 2, repo
        n = len(shards)
        assert sorted(shards) == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert [p.name for p in (root / repo).iterdir() if not p.name.startswith(".")] == [rev]
    total = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    assert total < 20 << 20  # a few MB per repo


def test_deterministic_across_roots_and_reruns(repos, tmp_path):
    _, revs = repos
    assert ck.write_synthetic_repos(tmp_path / "a") == revs
    assert ck.write_synthetic_repos(tmp_path / "a") == revs  # idempotent on the same root


@pytest.mark.parametrize("repo", [ck.INTEL, ck.DONOR, ck.HYBRID, ck.DFLASH])
def test_index_matches_headers(repos, repo):
    d = repo_dir(repos, repo)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    hs = headers(d)
    assert idx["weight_map"] == {n: f for n, (_, f) in hs.items()}
    assert idx["metadata"]["total_size"] == sum(t.nbytes for t, _ in hs.values())


def test_intel_int4_layout(repos):
    d = repo_dir(repos, ck.INTEL)
    hs = headers(d)
    cfg = json.loads((d / "config.json").read_text())
    tc = cfg["text_config"]
    assert cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert cfg["quantization_config"]["quant_method"] == "auto-round"
    assert cfg["quantization_config"]["bits"] == 4 and cfg["quantization_config"]["group_size"] == 128
    lm = "model.language_model"
    for layer, kind in enumerate(tc["layer_types"]):
        p = f"{lm}.layers.{layer}"
        assert kind == ("full_attention" if layer % 4 == 3 else "linear_attention")
        if kind == "full_attention":
            assert f"{p}.self_attn.q_proj.qweight" in hs and f"{p}.self_attn.q_norm.weight" in hs
        else:
            for part in ("in_proj_qkv.qweight", "in_proj_z.qweight", "in_proj_b.weight", "in_proj_a.weight",
                         "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.qweight"):
                assert f"{p}.linear_attn.{part}" in hs, part
        for e in range(tc["num_experts"]):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                qw, qz, sc = (hs[f"{p}.mlp.experts.{e}.{proj}.{x}"][0] for x in ("qweight", "qzeros", "scales"))
                assert (qw.dtype, qz.dtype, sc.dtype) == ("I32", "I32", "F16")
                assert qw.shape[0] * 8 == sc.shape[0] * 128  # in_features / 8 packed rows
        for proj in ("gate_proj", "up_proj", "down_proj"):
            assert hs[f"{p}.mlp.shared_expert.{proj}.weight"][0].dtype == "BF16"
        assert hs[f"{p}.mlp.gate.weight"][0].shape == (tc["num_experts"], tc["hidden_size"])
        assert hs[f"{p}.mlp.shared_expert_gate.weight"][0].shape == (1, tc["hidden_size"])
    for n in ("lm_head.weight", f"{lm}.embed_tokens.weight", f"{lm}.norm.weight"):
        assert hs[n][0].dtype == "BF16"
    mtp = {n: f for n, (_, f) in hs.items() if n.startswith("mtp.")}
    assert "mtp.fc.weight" in mtp and "mtp.layers.0.mlp.shared_expert.gate_proj.weight" in mtp
    assert set(mtp.values()) == {"model_extra_tensors.safetensors"}
    assert any(n.startswith("model.visual.") for n in hs)


def test_donor_fp8_block_scales(repos):
    hs = headers(repo_dir(repos, ck.DONOR))
    n = "model.language_model.layers.0.mlp.shared_expert.down_proj.weight"
    w, f = hs[n]
    s, _ = hs[n + "_scale_inv"]
    assert w.dtype == "F8_E4M3" and s.dtype == "F32"
    assert s.shape == (-(-w.shape[0] // 128), -(-w.shape[1] // 128))
    raw = np.frombuffer((repo_dir(repos, ck.DONOR) / f).read_bytes()[w.start:w.end], np.uint8)
    assert not np.isin(raw, [0x7F, 0xFF]).any()  # no E4M3 NaN codes
    assert hs["model.language_model.layers.0.mlp.gate.weight"][0].dtype == "BF16"
    assert hs["model.language_model.layers.0.mlp.experts.0.up_proj.weight"][0].dtype == "F8_E4M3"


def test_fp8_and_int4_encode_the_same_weights():
    """Both quantized repos are quantizations of one master weight."""
    name = "model.language_model.layers.0.mlp.shared_expert.up_proj.weight"
    w = ck.master(name, (ck.D.shared_inter, ck.D.hidden))
    q, sc, shape = ck.fp8_block_quant(w)
    deq = ck._E4M3[np.frombuffer(q, np.uint8) & 0x7F] * np.where(np.frombuffer(q, np.uint8) & 0x80, -1, 1)
    scales = np.frombuffer(sc, np.float32).reshape(shape)
    full = np.kron(scales, np.ones((128, 128)))[: w.shape[0], : w.shape[1]]
    np.testing.assert_allclose(deq.reshape(w.shape) * full, w, atol=float(np.abs(w).max()) / 16)


def test_hybrid_is_the_builders_output(repos):
    d = repo_dir(repos, ck.HYBRID)
    cfg = json.loads((d / "config.json").read_text())
    intel_cfg = json.loads((repo_dir(repos, ck.INTEL) / "config.json").read_text())
    info = cfg.pop("sparkfleet_hybrid")
    assert cfg == intel_cfg
    assert info["swapped"] == 3 * ck.D.layers
    assert info["int4"]["revision"] == repos[1][ck.INTEL]
    assert info["donor"]["revision"] == repos[1][ck.DONOR]
    hs = headers(d)
    assert hs["model.language_model.layers.0.mlp.shared_expert.up_proj.weight"][0].dtype == "F8_E4M3"
    assert hs["mtp.layers.0.mlp.shared_expert.up_proj.weight"][0].dtype == "BF16"


def test_dflash_drafter_has_no_head_of_its_own(repos):
    d = repo_dir(repos, ck.DFLASH)
    hs = headers(d)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 16
    assert "fc.weight" in hs and "layers.0.self_attn.q_proj.weight" in hs
    assert not any("embed_tokens" in n or n.startswith("lm_head") for n in hs)


def test_files_load_with_the_safetensors_package(repos):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    for repo in (ck.INTEL, ck.DONOR, ck.HYBRID):
        d = repo_dir(repos, repo)
        f = sorted(d.glob("model-*.safetensors"))[0]
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                t = st.get_tensor(k)
                assert t.numel() > 0
        if repo == ck.DONOR:
            n = "model.language_model.layers.0.mlp.shared_expert.gate_proj.weight"
            shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][n]
            with safe_open(str(d / shard), framework="pt") as st:
                assert st.get_tensor(n).dtype == torch.float8_e4m3fn


def test_served_repos_carry_one_real_tokenizer(repos):
    """The target repos (the hybrid copies it) ship the same tokenizer, the drafter none."""
    from sparkfleet.testbed.engine import tokenizer as tk

    served = [repo_dir(repos, r) for r in (ck.INTEL, ck.DONOR, ck.HYBRID)]
    files = {(d / "tokenizer.json").read_bytes() for d in served}
    assert len(files) == 1
    assert not (repo_dir(repos, ck.DFLASH) / "tokenizer.json").exists()
    for d in served:
        config = json.loads((d / "tokenizer_config.json").read_text())
        assert config["tokenizer_class"] == "Qwen2Tokenizer" and "<tool_call>" in config["chat_template"]
        assert (d / "chat_template.jinja").read_text() == config["chat_template"]
    tok = tk.Tokenizer.from_file(served[0] / "tokenizer.json")
    assert len(tok) == ck.D.vocab and tok.count("The capital of France is Paris.") > 1
