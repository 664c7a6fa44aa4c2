#!/usr/bin/env python3
"""fla_shmem: let FLA's GDN chunk kernels use their big tiles on sm12x (GB10).

FLA picks its chunk-kernel tile sizes (``chunk_o.BKV_LIST``, ``cumsum.BS_LIST``) with
``check_shared_mem()``, which compares the device's per-block shared memory with a
100 KiB default bar. GB10 (sm121) has 99 KiB (101 376 bytes) - 1 KiB short - so it gets
the small tiles although the big-tile configs fit in 99 KiB (the same budget FLA
accepts for Ada). The patch uses Ada's bar on compute capability 12.x. Prefill/TTFT
only: decode runs the recurrent kernel. Harmless, so serve.py tolerates its failure.

Not needed: from vLLM ~0.30 GDN prefill on sm12x defaults to FlashInfer's kernel
(``_resolve_gdn_prefill_backend`` lists capability family 120), so FLA's chunk kernels
are off the default path. Already present: ``check_shared_mem`` itself already asks the
device's compute capability (an image's own sm12x edit).
"""
from __future__ import annotations

import sys

try:  # imported as runtime.patches.<name> (controller, tests)
    from . import _patchlib as pl
except ImportError:  # run as a program (/host/patches/<name>.py): its directory is sys.path[0]
    import _patchlib as pl

NAME = "fla_shmem"
CANDIDATES = (
    "vllm/model_executor/layers/fla/ops/utils.py",
    "vllm/third_party/flash_linear_attention/ops/utils.py",
)
FUNC = "check_shared_mem"
GDN_DIR = "vllm/model_executor/layers/mamba"
RESOLVER = "_resolve_gdn_prefill_backend"

ANCHOR = """\
        max_shared_memory = device_shared_mem_list[tensor_idx]
        return max_shared_memory >= Backend.get_shared_memory(arch)
"""

REPLACEMENT = f"""\
        max_shared_memory = device_shared_mem_list[tensor_idx]
        # {pl.sentinel(NAME)} sm12x has 99 KiB per block, 1 KiB under the default
        # bar; the big tiles fit (Ada's budget), so use Ada's bar there.
        if arch == "none" and _sparkfleet_is_sm12x(tensor_idx):
            return max_shared_memory >= Backend.ADA.value
        return max_shared_memory >= Backend.get_shared_memory(arch)
"""

HELPER = f'''\
# {pl.sentinel(NAME)} helper for check_shared_mem (sparkfleet runtime patch).
def _sparkfleet_is_sm12x(device_index):
    try:
        return (
            torch.version.hip is None
            and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device_index)[0] == 12
        )
    except Exception:
        return False
'''


def gdn_prefill_off_fla(vllm: pl.Vllm) -> str | None:
    """Reason to skip when this vLLM routes sm12x GDN prefill to FlashInfer."""
    gdn_dir = vllm.path(GDN_DIR)
    if not gdn_dir.is_dir():
        return None
    for path in sorted(gdn_dir.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        if f"def {RESOLVER}(" not in text:
            continue
        source = pl.def_source(text, RESOLVER) or ""
        if "is_device_capability_family(120)" in source:
            return (
                f"GDN prefill on sm12x defaults to FlashInfer ({vllm.rel(path)}:{RESOLVER}); "
                "FLA chunk kernels are off the default path"
            )
    return None


def asks_capability(text: str) -> str | None:
    """The fix in another form: the bar already depends on the device's capability."""
    for ident in ("get_device_capability", "is_device_capability", "is_device_capability_family"):
        if pl.code_uses(text, FUNC, ident):
            return f"{FUNC}() already sets the bar by compute capability ({ident})"
    return None


def apply(vllm: pl.Vllm) -> pl.Verdict:
    path = pl.find_defining_file(vllm, CANDIDATES, FUNC)
    edit = pl.Edit("shared-memory bar", ANCHOR, REPLACEMENT, scope=FUNC)
    return pl.patch_file(
        vllm, NAME, path, [edit], append=HELPER, present=asks_capability,
        gate=lambda _text: gdn_prefill_off_fla(vllm),
    )


if __name__ == "__main__":
    sys.exit(pl.run(NAME, apply))
