"""serve.env written once: runtime/serve_args.py's SERVE_ENV, and what is made from it.

``Settings.serve_env()`` renders it, docs/architecture.md's table and the golden env files
(tests/runtime/envs/) are generated from it: each is checked here, so a change to one
without the others fails. ``python tests/support/runtime_env.py`` rewrites the doc's table
and the golden files.
"""
from __future__ import annotations

import dataclasses
import runpy

import pytest
from support.runtime_env import (
    ARCHITECTURE,
    ENV_DIR,
    EXPECTED_ARGV,
    PROFILES,
    REPO,
    documented_table,
    golden_env_text,
    profile_env,
    rendered_env,
)

from runtime import serve_args as sa
from sparkfleet.config import Settings, validate_host_data
from sparkfleet.pairs import Pair, PairMember

REGENERATE = "run `python tests/support/runtime_env.py` and review the diff"


@pytest.mark.parametrize("profile", PROFILES)
def test_golden_env_file_is_what_the_deploy_renders(profile: str) -> None:
    golden = (ENV_DIR / f"{profile}.env").read_text()
    assert golden == golden_env_text(profile), f"tests/runtime/envs/{profile}.env drifted: {REGENERATE}"
    # And the order is the table's: serve.env does not change when nothing did.
    assert list(profile_env(profile)) == [v.name for v in sa.SERVE_ENV if v.name in profile_env(profile)]
    # The hand-written truth of the argv still holds for what the deploy renders.
    assert sa.build_serve_argv(rendered_env(profile)) == EXPECTED_ARGV[profile]


def test_architecture_table_is_generated_from_the_data() -> None:
    assert documented_table(ARCHITECTURE.read_text()) == sa.doc_table(), f"docs/architecture.md drifted: {REGENERATE}"


def test_every_variable_names_a_setting_and_a_known_rendering() -> None:
    fields = set(Settings.model_fields)
    for var in sa.SERVE_ENV:
        if var.render == "fixed":
            assert not var.setting and var.fixed, var
            continue
        if var.setting.startswith("pair."):  # a pair member's place in its pair
            name = var.setting[5:]
            assert name in PairMember.__dataclass_fields__ or isinstance(getattr(Pair, name, None), property) \
                or name in Pair.__dataclass_fields__, var
        else:
            assert var.setting in fields or isinstance(getattr(Settings, var.setting, None), property), var
        assert var.render in sa._RENDER, var
        assert var.maps  # an unknown argv kind raises KeyError here
    assert len(sa.VARS) == len(sa.SERVE_ENV), "a variable is listed twice"


def test_serve_env_is_the_table_plus_vllm_env() -> None:
    env = rendered_env("dense")
    assert set(env) == {v.name for v in sa.SERVE_ENV if v.need != sa.IF_SET}
    defaults = {k: v for k, v in runpy.run_path(str(REPO / "group_data/all.py")).items() if not k.startswith("__")}
    s = validate_host_data("spark-1", {**defaults, "hf_endpoint": "http://10.0.0.1:8090",
                                       "vllm_env": {"VLLM_LOGGING_LEVEL": "DEBUG"}})
    env = s.serve_env()
    assert env["HF_ENDPOINT"] == "http://10.0.0.1:8090"
    assert list(env)[-2:] == ["HF_ENDPOINT", "VLLM_LOGGING_LEVEL"]


def test_a_pair_member_runs_vllms_multi_node_mode() -> None:
    """Rank 0 serves HTTP, rank 1 runs headless; both rendezvous at the head's link address,
    NCCL/Gloo on the link; vllm_env overrides what the pair derives."""
    defaults = {k: v for k, v in runpy.run_path(str(REPO / "group_data/all.py")).items() if not k.startswith("__")}
    s = validate_host_data("spark-2", {**defaults, "vllm_env": {"NCCL_IB_HCA": "rocep1s0f1"}})
    addresses = ("192.168.100.1", "192.168.100.2")
    head = PairMember(Pair("pair_a", ("spark-1", "spark-2"), 0, addresses, 24, 29500), "enp1s0f1np1", "a,b")
    worker = PairMember(Pair("pair_a", ("spark-1", "spark-2"), 1, addresses, 24, 29500), "enp1s0f1np1", "a,b")
    multi = ["--tensor-parallel-size", "2", "--nnodes", "2"]
    head_argv, worker_argv = sa.build_serve_argv(s.serve_env(head)), sa.build_serve_argv(s.serve_env(worker))
    assert " ".join([*multi, "--node-rank", "0", "--master-addr", "192.168.100.1", "--master-port", "29500"]) \
        in " ".join(head_argv)
    assert "--headless" not in head_argv
    assert " ".join(["--node-rank", "1", "--master-addr", "192.168.100.1", "--master-port", "29500",
                     "--headless"]) in " ".join(worker_argv)
    env = s.serve_env(worker)
    assert env["VLLM_HOST_IP"] == "192.168.100.2"
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == "enp1s0f1np1"
    assert env["NCCL_IB_HCA"] == "rocep1s0f1"  # vllm_env wins
    # The pinned 0.23 image: no cross-node CUDA graphs (vLLM #46253), no custom all-reduce; RoCE's GID.
    eager = PairMember(worker.pair, "enp1s0f1np1", "a,b", gid_index="3", enforce_eager=s.pair_enforce_eager,
                       disable_custom_all_reduce=s.pair_disable_custom_all_reduce)
    eager_env = s.serve_env(eager)
    assert eager_env["NCCL_IB_GID_INDEX"] == "3"
    assert {"--enforce-eager", "--disable-custom-all-reduce"} <= set(sa.build_serve_argv(eager_env))
    graphs = PairMember(worker.pair, "enp1s0f1np1", "a,b", enforce_eager=False, disable_custom_all_reduce=True)
    assert "--enforce-eager" not in sa.build_serve_argv(s.serve_env(graphs))
    # A host that serves alone keeps the serve.env and command it had.
    alone = validate_host_data("spark-3", defaults).serve_env()
    assert not any(k.startswith(("NCCL_", "VLLM_HOST")) or k in ("SF_NODE_RANK", "SF_HEADLESS", "SF_ENFORCE_EAGER") for k in alone)
    assert "--nnodes" not in sa.build_serve_argv(alone)


def test_flags_come_from_the_table(monkeypatch) -> None:
    """A flag changed in the data changes the argv: there is no second copy of it."""
    env = profile_env("base")
    renamed = tuple(
        dataclasses.replace(v, flag=" ".join("--x-" + w[2:] for w in v.flag.split())) for v in sa.SERVE_ENV
    )
    monkeypatch.setattr(sa, "SERVE_ENV", renamed)
    argv = sa.build_serve_argv(env)
    assert argv[argv.index("--x-max-model-len") + 1] == env["SF_MAX_MODEL_LEN"]
    assert "--x-enable-chunked-prefill" in argv and "--no-x-enable-prefix-caching" in argv
    assert [a for a in argv if a.startswith("--") and not a.startswith(("--x-", "--no-x-"))] == []


def test_patches_setting_replaces_the_profiles_plan() -> None:
    """`--data patches=...` is how a patch that cannot apply to an image is dropped."""
    defaults = {k: v for k, v in runpy.run_path(str(REPO / "group_data/all.py")).items() if not k.startswith("__")}

    def plan(**data) -> str:
        return validate_host_data("spark-1", {**defaults, **data}).serve_env()["SF_PATCHES"]

    assert plan() == "kv_unify,inc_fp8_shared,int8_lmhead,fla_shmem"  # dense's own
    assert plan(patches="inc_fp8_shared,int8_lmhead,fla_shmem") == "inc_fp8_shared,int8_lmhead,fla_shmem"
    assert plan(patches=["fla_shmem"]) == "fla_shmem"
    assert plan(patches="") == ""
    with pytest.raises(ValueError, match="nonsense"):
        plan(patches="kv_unify,nonsense")
