"""``serve.py --check``: the patch plan's verdicts against real and image-edited vLLM trees.

Real serving images are vLLM 0.23.0 plus PR overlays and in-image edits (platforms/cuda.py,
v1/core/kv_cache_utils.py, v1/engine/core.py, v1/worker/gpu_model_runner.py,
model_executor/layers/mamba/abstract.py, config/compilation.py). The trees here are the
real 0.23.0 / 0.33.0 files, edited the way such images edit them, and each verdict is
proven: would apply, already present (ours, upstream's, or the image's own form), not
needed, cannot apply (with the file and the fix). The check writes nothing and exits 1
only when a required patch cannot apply.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from support.runtime_env import RUNTIME_DIR
from support.vllm_source import VLLM_IMAGE_VERSION, VLLM_NEWEST_VERSION

pytestmark = pytest.mark.network  # the vLLM sdists, once

V23, V33 = VLLM_IMAGE_VERSION, VLLM_NEWEST_VERSION
ALL = ["kv_unify", "prefix_align", "inc_fp8_shared", "int8_lmhead", "fla_shmem"]
KV = "vllm/v1/core/kv_cache_utils.py"
CORE = "vllm/v1/engine/core.py"
COMPILATION = "vllm/config/compilation.py"
INC = "vllm/model_executor/layers/quantization/inc.py"
FLA = "vllm/model_executor/layers/fla/ops/utils.py"
# The other files real images edit; no patch reads them, so edits there change no verdict.
OTHER_EDITED = (
    "vllm/platforms/cuda.py",
    "vllm/v1/worker/gpu_model_runner.py",
    "vllm/model_executor/layers/mamba/abstract.py",
)
IMAGE_FILES = (CORE, COMPILATION, *OTHER_EDITED)


def edit(root: Path, rel: str, old: str, new: str) -> None:
    path = root / rel
    text = path.read_text()
    assert text.count(old) == 1, (rel, old)
    path.write_text(text.replace(old, new, 1))


def image_edits(root: Path) -> Path:
    """What such images do beside the patches' anchors: None-safe block-size minimums in
    kv_cache_utils.py and engine/core.py, changed compilation defaults, small fixes
    elsewhere. Every patch must still find its anchors."""
    edit(root, KV, "    group_block_sizes = [g.kv_cache_spec.block_size for g in groups]\n",
         "    group_block_sizes = [\n"
         "        g.kv_cache_spec.block_size for g in groups\n"
         "        if g.kv_cache_spec.block_size is not None\n"
         "    ]\n")
    edit(root, KV, "    min_num_blocks = min(\n        kv_cache_config.num_blocks for kv_cache_config in kv_cache_configs\n    )\n",
         "    min_num_blocks = min(\n        (c.num_blocks for c in kv_cache_configs if c.num_blocks is not None),\n"
         "        default=0,\n    )\n")
    edit(root, CORE, "min(\n                g.kv_cache_spec.block_size for g in kv_cache_groups\n            )",
         "min(\n                (g.kv_cache_spec.block_size for g in kv_cache_groups\n"
         "                 if g.kv_cache_spec.block_size is not None),\n"
         "                default=vllm_config.cache_config.block_size,\n            )")
    (root / COMPILATION).write_text((root / COMPILATION).read_text().replace(
        "class CompilationConfig", "# image: sm121 capture sizes\n_SM121_MAX_CAPTURE_SIZE = 512\n\n\nclass CompilationConfig", 1))
    for rel in OTHER_EDITED:
        (root / rel).write_text((root / rel).read_text() + "\n# image: GB10 (sm121) build of this file\n")
    return root


def image_own_fixes(root: Path) -> Path:
    """An image that carries each fix in its own form (its dflashfix edit, the INC PR as an
    overlay, its own sm12x shared-memory bar): the patches' anchors are gone."""
    edit(root, KV,
         "            if max_page_size % layer_page_size != 0:\n"
         "                raise NotImplementedError(\n"
         '                    "The page size of the layer is not divisible by the "\n'
         '                    "maximum page size. Cannot unify by adjusting block_size."\n'
         "                )\n"
         "            ratio = max_page_size // layer_page_size\n"
         "            new_block_size = layer_spec.block_size * ratio\n"
         "            new_spec = replace(layer_spec, block_size=new_block_size)\n"
         "            assert new_spec.page_size_bytes == max_page_size\n",
         "            ratio = max_page_size // layer_page_size\n"
         "            new_spec = replace(layer_spec, block_size=layer_spec.block_size * ratio)\n"
         "            if new_spec.page_size_bytes != max_page_size:  # dflashfix: pad the rest\n"
         "                new_spec = replace(new_spec, page_size_padded=max_page_size)\n")
    edit(root, KV,
         "    if any(\n"
         "        isinstance(g.kv_cache_spec, MambaSpec)\n"
         "        and g.kv_cache_spec.block_size != cache_config.block_size\n"
         "        for g in groups\n"
         "    ):\n"
         "        return scheduler_block_size, scheduler_block_size\n",
         "    # dflashfix: drafter groups diverge; hash every group by the GCD.\n")
    edit(root, INC, "    def get_quant_method(self, layer: torch.nn.Module, prefix: str):\n",
         "    def maybe_update_config(self, model_name, hf_config=None, revision=None):\n"
         "        from vllm.transformers_utils.config import get_safetensors_params_metadata\n"
         "        self.fp8_layers = [\n"
         "            name for name, info in get_safetensors_params_metadata(model_name).items()\n"
         '            if info.get("dtype") == "F8_E4M3"\n'
         "        ]\n\n"
         "    def get_quant_method(self, layer: torch.nn.Module, prefix: str = \"\"):\n")
    edit(root, FLA, "        return max_shared_memory >= Backend.get_shared_memory(arch)\n",
         "        if torch.cuda.get_device_capability(tensor_idx)[0] == 12:\n"
         "            return max_shared_memory >= Backend.ADA.value\n"
         "        return max_shared_memory >= Backend.get_shared_memory(arch)  # image\n")
    return root


def dense_env() -> dict[str, str]:
    return {line.split("=", 1)[0]: line.split("=", 1)[1]
            for line in (RUNTIME_DIR.parent / "tests/runtime/envs/dense.env").read_text().splitlines()
            if line and not line.startswith("#")}


def check(root: Path, patches: list[str] = ALL, **serve_env: str) -> tuple[int, dict, str]:
    # The whole serve.env, as the deploy passes it; these trees' vLLM is not importable,
    # so the command's check asks the simulated engine's command line (as the testbed image does).
    env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "SPARKFLEET_VLLM_ROOT": str(root),
           **dense_env(), "SF_PATCHES": ",".join(patches), **serve_env,
           "SPARKFLEET_VLLM_CLI": "sparkfleet.testbed.engine.flags"}
    proc = subprocess.run([sys.executable, str(RUNTIME_DIR / "serve.py"), "--check"],
                          env=env, capture_output=True, text=True, timeout=300, cwd="/")
    return proc.returncode, json.loads(proc.stdout), proc.stderr  # stdout: one JSON document


def verdicts(doc: dict) -> dict[str, str]:
    return {p["name"]: p["verdict"] for p in doc["patches"]}


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def serve(root: Path, patches: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """The real start (patches written), with a stand-in vllm that only exits."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "vllm").write_text("#!/bin/sh\nexit 0\n")
    (bindir / "vllm").chmod(0o755)
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "LANG": "C.UTF-8", "SPARKFLEET_VLLM_ROOT": str(root)}
    env |= dense_env()
    env["SF_PATCHES"] = ",".join(patches)
    return subprocess.run([sys.executable, str(RUNTIME_DIR / "serve.py")], env=env,
                          capture_output=True, text=True, timeout=300)


def test_upstream_023_would_apply_everything_and_writes_nothing(vllm_tree) -> None:
    root = vllm_tree(V23)
    before = snapshot(root)
    rc, doc, _ = check(root)
    assert rc == 0 and doc["ok"] is True
    assert doc["vllm"]["version"] == V23 and doc["vllm"]["root"] == str(root)
    assert verdicts(doc) == dict.fromkeys(ALL, "would-apply")
    assert {p["name"]: p["file"] for p in doc["patches"]}["inc_fp8_shared"] == INC
    assert snapshot(root) == before


def test_upstream_033_knows_what_upstream_fixed(vllm_tree) -> None:
    rc, doc, _ = check(vllm_tree(V33))
    assert rc == 0 and doc["ok"] is True
    assert verdicts(doc) == {
        "kv_unify": "already-present",  # kv_cache_planning.py pads pages itself
        "prefix_align": "already-present",  # align-mode mamba groups hash by the GCD
        "inc_fp8_shared": "would-apply",
        "int8_lmhead": "would-apply",
        "fla_shmem": "not-needed",  # sm12x GDN prefill goes to FlashInfer
    }


def test_image_edits_beside_the_anchors_change_no_verdict(vllm_tree, tmp_path: Path) -> None:
    root = image_edits(vllm_tree(V23, extra=IMAGE_FILES))
    before = snapshot(root)
    rc, doc, _ = check(root)
    assert rc == 0 and verdicts(doc) == dict.fromkeys(ALL, "would-apply"), doc
    assert snapshot(root) == before
    # And the start really applies them; the check then says "already present".
    proc = serve(root, ALL, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count(": applied: ") == len(ALL)
    rc, doc, _ = check(root)
    assert rc == 0 and verdicts(doc) == dict.fromkeys(ALL, "already-present")
    assert all("earlier start" in p["detail"] for p in doc["patches"])


def test_image_carrying_the_fixes_in_its_own_form_is_already_present(vllm_tree, tmp_path: Path) -> None:
    root = image_own_fixes(image_edits(vllm_tree(V23, extra=IMAGE_FILES)))
    rc, doc, _ = check(root)
    assert rc == 0 and doc["ok"] is True, doc
    assert verdicts(doc) == {
        "kv_unify": "already-present",
        "prefix_align": "already-present",
        "inc_fp8_shared": "already-present",
        "int8_lmhead": "would-apply",  # not upstream anywhere: still ours to apply
        "fla_shmem": "already-present",
    }
    details = {p["name"]: p["detail"] for p in doc["patches"]}
    assert "pads pages" in details["kv_unify"] and "no mamba back-off" in details["prefix_align"]
    assert "safetensors metadata" in details["inc_fp8_shared"]
    assert "compute capability" in details["fla_shmem"]
    # The start agrees: it serves, applying only what is not there yet.
    proc = serve(root, ALL, tmp_path)
    assert proc.returncode == 0, proc.stdout
    assert "patch kv_unify: already present:" in proc.stdout
    assert "patch int8_lmhead: applied:" in proc.stdout


def test_missing_anchor_cannot_apply_naming_file_and_fix(vllm_tree) -> None:
    root = image_edits(vllm_tree(V23, extra=IMAGE_FILES))
    edit(root, KV, "ratio = max_page_size // layer_page_size", "ratio = max_page_size // (layer_page_size)")
    before = snapshot(root)
    plan = ["kv_unify", "inc_fp8_shared", "int8_lmhead", "fla_shmem"]
    rc, doc, _ = check(root, plan)
    assert rc == 1 and doc["ok"] is False
    assert verdicts(doc) == {"kv_unify": "cannot-apply", "inc_fp8_shared": "would-apply",
                             "int8_lmhead": "would-apply", "fla_shmem": "would-apply"}
    kv = doc["patches"][0]
    assert kv["required"] is True and kv["file"] == KV
    assert "missing anchor" in kv["detail"] and f"vLLM {V23}" in kv["detail"]
    assert "pin another image" in kv["fix"] and "SF_PATCHES=inc_fp8_shared,int8_lmhead,fla_shmem" in kv["fix"]
    assert snapshot(root) == before


def test_tolerated_patch_that_cannot_apply_keeps_the_check_ok(vllm_tree) -> None:
    root = vllm_tree(V23)
    edit(root, FLA, "return max_shared_memory >= Backend.get_shared_memory(arch)",
         "return Backend.get_shared_memory(arch) <= max_shared_memory")
    rc, doc, _ = check(root, ["fla_shmem"])
    assert rc == 0 and doc["ok"] is True
    (fla,) = doc["patches"]
    assert fla["verdict"] == "cannot-apply" and fla["required"] is False and fla["file"] == FLA


def test_no_vllm_and_bad_plan(tmp_path: Path) -> None:
    rc, doc, _ = check(tmp_path, ["kv_unify"])
    assert rc == 1 and doc["ok"] is False and "no vllm/ package" in doc["vllm"]["error"]
    assert doc["patches"][0]["verdict"] == "cannot-apply"
    rc, doc, _ = check(tmp_path, ["kv_unify", "nonsense"])
    assert rc == 2 and doc["ok"] is False and "nonsense" in doc["error"]


@pytest.mark.parametrize(("serve_env", "var", "said"), [
    ({"SF_EXTRA_ARGS": '["--max-loras", "2", "stray"]'}, "SF_EXTRA_ARGS", "unrecognized arguments: stray"),
    ({"SF_EXTRA_ARGS": '["--no-such-flag"]'}, "SF_EXTRA_ARGS", "unrecognized arguments: --no-such-flag"),
    ({"SF_EXTRA_ARGS": '["--max-loras", "two"]'}, "SF_EXTRA_ARGS", "argument --max-loras: invalid int value"),
    ({"SF_TOOL_CALL_PARSER": "bogus"}, "SF_TOOL_CALL_PARSER", "invalid tool call parser: bogus"),
    ({"SF_REASONING_PARSER": "bogus"}, "SF_REASONING_PARSER", "invalid reasoning parser: bogus"),
    ({"SF_MIDDLEWARE": "no_such_module.Guard"}, "SF_MIDDLEWARE", "--middleware no_such_module.Guard does not import"),
])
def test_a_command_the_image_refuses_fails_the_check_naming_the_variable(vllm_tree, serve_env, var, said) -> None:
    rc, doc, _ = check(vllm_tree(V23), ["fla_shmem"], **serve_env)
    assert rc == 1 and doc["ok"] is False
    assert doc["args"]["ok"] is False and doc["args"]["var"] == var, doc["args"]
    assert said in doc["args"]["detail"], doc["args"]
    assert {p["name"]: p["verdict"] for p in doc["patches"]} == {"fla_shmem": "would-apply"}


def test_the_rendered_command_passes_and_is_recorded(vllm_tree) -> None:
    rc, doc, _ = check(vllm_tree(V23), ["fla_shmem"])
    assert rc == 0 and doc["args"]["ok"] is True
    assert doc["args"]["argv"][-2:] == ["--middleware", "key_guard.KeyGuard"]
    assert "--speculative-config" in doc["args"]["argv"]
