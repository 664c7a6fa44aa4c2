"""The serving profiles, as data.

A profile names what the reference recipe measured: which checkpoint is served, which speculative
decoder drafts for it and which runtime patches the installed vLLM needs. Everything a
profile does not fix (context, batch sizes, parsers...) lives in ``group_data/all.py``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

INTEL_INT4 = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
HYBRID_INT4_FP8 = "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid"
DFLASH_DRAFTER = "z-lab/Qwen3.5-122B-A10B-DFlash"
FP8_DONOR = "Qwen/Qwen3.5-122B-A10B-FP8"


class Profile(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    description: str
    model: str
    # "dflash", "qwen3_5_mtp" or None for plain decode.
    speculative_method: str | None = None
    num_speculative_tokens: int = 0
    drafter: str | None = None
    # Patches the serve wrapper applies before vLLM starts (see runtime/patches/).
    patches: tuple[str, ...] = ("fla_shmem",)
    # The reference recipe's published single-stream numbers, for the report.
    measured: str = ""


PROFILES: dict[str, Profile] = {
    "dense": Profile(
        description="hybrid INT4+FP8 checkpoint + int8 lm-head + DFlash n=12",
        model=HYBRID_INT4_FP8,
        speculative_method="dflash",
        num_speculative_tokens=12,
        drafter=DFLASH_DRAFTER,
        patches=("kv_unify", "inc_fp8_shared", "int8_lmhead", "fla_shmem"),
        measured="36.0 tok/s base decode (+28%), 59.0 tok/s by albond's end-to-end method",
    ),
    "dflash": Profile(
        description="Intel INT4 + DFlash n=12 (agents, tool calls, code)",
        model=INTEL_INT4,
        speculative_method="dflash",
        num_speculative_tokens=12,
        drafter=DFLASH_DRAFTER,
        patches=("kv_unify", "fla_shmem"),
        measured="~81 tok/s on agent turns, 53.7 tok/s by albond's end-to-end method",
    ),
    "base": Profile(
        description="Intel INT4, no speculative decoding (baseline)",
        model=INTEL_INT4,
        measured="28.2 tok/s single stream",
    ),
    "mtp": Profile(
        description="Intel INT4 + the checkpoint's native MTP-2 head",
        model=INTEL_INT4,
        speculative_method="qwen3_5_mtp",
        num_speculative_tokens=2,
        measured="~40 tok/s on agent turns",
    ),
}
