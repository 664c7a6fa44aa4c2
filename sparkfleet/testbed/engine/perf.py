"""The GB10 performance model: how fast the simulated engine answers a request.

A request's speed depends on three things, as on a real Spark:

* its **workload** (what the answer is: prose, code, counting, an agent's tool-call
  turn, a plain chat answer; see ``text.workload_of``), which sets the speculative
  **acceptance** (mean tokens per decode step) of each method;
* the **profile**: the speculative method and its depth ``k`` and the dense levers
  (FP8 shared experts of the hybrid checkpoint, the int8 lm-head patch), which set the
  **step time** of one decode step;
* the prompt's length, which sets the **time to the first token** through a prefill
  rate, and the number of requests decoding at once, which slows every stream.

Decode rate = acceptance / step time. Every number comes from the reference recipe's
published measurements (GB10, single stream, temperature 0: its README's tables, its
FINDINGS and its announcement), except where a comment says
"assumed": the reference does not measure it and the value is a stated choice.

Where the numbers come from
---------------------------
``DFLASH_12``/``MTP_2``: the "DFlash vs MTP" table (acceptance and decode-only tok/s per
workload at n=12 / k=2). The step time at the reference depth is acceptance / tok/s;
e.g. DFlash on code: 5.4 / 54.5 = 99 ms per step, against 35.5 ms (1 / 28.2) for one
plain decode step. For another depth the acceptance follows a geometric per-position
model fitted at the reference depth, and the part of the step beyond a plain decode
step (drafting, verifying k + 1 positions) scales with k + 1 (assumed).

``chat`` (a chat answer without tools: albond's five end-to-end prompts) has no
decode-only number in the reference, only albond's end-to-end 53.7 at acceptance 6.5
(dense: 59.0 at 6.4). Its step time is the one at which albond's method over those five
prompts, with this module's prefill model and the simulated model's answer lengths,
reads 53.7 (``tests/testbed/test_engine_perf.py`` recomputes it).

Dense levers: without speculation FP8 shared experts take 28.2 -> 30.4 tok/s and the
int8 lm-head 28.2 -> 32.7, both 36.0: step savings of 2.6 and 4.9 ms that add up
(7.7 ms, as the FINDINGS say). Under speculation the reference measured them on two
workloads only: +10% on albond's e2e (acceptance 6.4) and ~0 on agent turns (8.3,
"80-87, noise"). ``LEVER_SCALE`` is the fraction of the no-speculation saving a step
keeps per workload: calibrated on chat (59.0), 0 on agent turns, 1 where unmeasured
(the verify forward reads each dense weight once per step, as a plain step does).

Concurrency: the announcement's table (dense profile, decode-only tok/s per stream at
1/2/3 streams: prose 48.8/38.4/30.8, code 66.9/55.3/43.0, agentic 121.8/98.9/66.7). The
step time of every running stream is multiplied by tok/s(1) / tok/s(c) of its workload;
beyond 3 streams the 2 -> 3 increment repeats (assumed), and the same ratios hold for
every profile (assumed: the reference measured them on dense only).

Prefill (assumed: the reference publishes no TTFT): the first token comes
``TTFT_FIXED_S`` plus the prompt's tokens at ``PREFILL_TOK_S`` after the request.

Tensor parallelism over two Sparks (``--tensor-parallel-size 2 --nnodes 2``, see
``multinode.py``): ``tensor_parallel_step_s``. A decode step of this MoE model is bound by
memory bandwidth: each step reads the active weights (and KV/state) once. With TP=N each
GB10 reads 1/N of them from its own 273 GB/s, so that part of the step takes 1/N of the
time. What TP adds is the all-reduce of the hidden state after every row-parallel layer:
two per decoder layer (the attention / linear-attention output and the MoE output) and one
gather of the sharded lm-head's logits, 2 x 48 + 1 = 97 per forward over the ConnectX-7
link. Each moves ``tokens x hidden 3072 x 2 bytes`` (6 KiB for one token, 78 KiB for a
DFlash verify of 13), at most 3 us at 200 Gb/s: the cost is NCCL's latency for a small
message between two nodes over RoCE, ``ALLREDUCE_LATENCY_S`` = 25 us (assumed: nccl-tests
report some 15-30 us for small all-reduces between two 200 Gb/s RoCE/IB nodes). A plain
step: 35.5 ms / 2 + 97 x 25.2 us = 20.2 ms, 1.76x one Spark (49.6 against 28.2 tok/s); a
DFlash step on code (99 ms) gains 1.9x. That sits where the peers' two-Spark reports put
a pair (about 1.6-1.9x one Spark on decode); a real pair also pays per-step fixed costs
(scheduling, sampling) that do not halve, which this model leaves out (assumed small
against 35 ms). ``SIM_DECODE_TOK_S`` still sets the rate as given.

Simulator-only overrides (environment): ``SIM_DECODE_TOK_S`` (every workload's decode
rate at one stream), ``SIM_ACCEPT_LEN`` (every workload's acceptance, capped at k + 1),
``SIM_TTFT_S`` (a fixed TTFT, prompt length ignored), ``SIM_PREFILL_TOK_S``,
``SIM_READY_DELAY_S`` (default 3 s).
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

from .logs import StartupError, log

PROSE, CODE, COUNTING, AGENT, CHAT = "prose", "code", "counting", "agent", "chat"
WORKLOADS = (PROSE, CODE, COUNTING, AGENT, CHAT)

BASE_TOK_S = 28.2  # plain INT4, no speculation
PLAIN_STEP_S = 1.0 / BASE_TOK_S
# Without speculation: 28.2 -> 30.4 with the hybrid's FP8 shared experts, -> 36.0 with the
# int8 lm-head on top (alone it gives 32.7: the two nearly add up).
FP8_SHARED_SAVING_S = 1.0 / 28.2 - 1.0 / 30.4
INT8_LM_HEAD_SAVING_S = 1.0 / 30.4 - 1.0 / 36.0

# Calibrated (see the module docstring): step time of a chat answer under DFlash n=12, and
# the share of the dense levers' saving it keeps.
CHAT_DFLASH_STEP_S = 0.11710
CHAT_LEVER_SCALE = 1.633

# (acceptance, decode-only tok/s) at the reference depth.
DFLASH_DEPTH = 12
DFLASH_12: dict[str, tuple[float, float]] = {
    PROSE: (2.3, 33.2), CODE: (5.4, 54.5), COUNTING: (11.0, 124.5), AGENT: (8.3, 81.0),
    CHAT: (6.5, 6.5 / CHAT_DFLASH_STEP_S),
}
MTP_DEPTH = 2
MTP_2: dict[str, tuple[float, float]] = {
    PROSE: (2.24, 33.7), CODE: (2.77, 40.5), COUNTING: (3.0, 43.7), AGENT: (2.88, 39.9),
    CHAT: (2.77, 40.5),  # not measured: as code
}
# The hybrid checkpoint drafts slightly worse on albond's prompts (6.4 against 6.5).
HYBRID_ACCEPT_FACTOR = {CHAT: 6.4 / 6.5}
LEVER_SCALE = {PROSE: 1.0, CODE: 1.0, COUNTING: 1.0, AGENT: 0.0, CHAT: CHAT_LEVER_SCALE}

# Per-stream decode tok/s at 1, 2, 3 streams (announcement, dense profile).
CONCURRENCY_TOK_S = {PROSE: (48.8, 38.4, 30.8), CODE: (66.9, 55.3, 43.0), AGENT: (121.8, 98.9, 66.7)}
CONCURRENCY_CLASS = {PROSE: PROSE, CODE: CODE, COUNTING: CODE, CHAT: CODE, AGENT: AGENT}

TTFT_FIXED_S = 0.12  # assumed: scheduling, the first forward and the HTTP round trip
PREFILL_TOK_S = 2500.0  # assumed
DEFAULT_READY_DELAY_S = 3.0

# Tensor parallelism (module docstring): Qwen3.5-122B-A10B's 48 layers, hidden size 3072.
TP_LAYERS = 48
TP_HIDDEN = 3072
ALLREDUCES_PER_FORWARD = 2 * TP_LAYERS + 1
ALLREDUCE_LATENCY_S = 25e-6  # assumed: a small NCCL all-reduce between two nodes over RoCE
LINK_BYTES_S = 200e9 / 8  # ConnectX-7: 200 Gb/s


def tensor_parallel_step_s(step_s: float, tp: int, tokens: int = 1) -> float:
    """A decode step of ``step_s`` on one Spark, with the model split over ``tp`` Sparks
    that verify ``tokens`` positions per step: the bandwidth-bound part over ``tp``, plus
    the all-reduces over the link (module docstring)."""
    if tp <= 1:
        return step_s
    per_rank_bytes = 2 * (tp - 1) / tp * tokens * TP_HIDDEN * 2  # ring all-reduce, bf16
    return step_s / tp + ALLREDUCES_PER_FORWARD * (ALLREDUCE_LATENCY_S + per_rank_bytes / LINK_BYTES_S)


def acceptance_at(accept_ref: float, depth_ref: int, depth: int) -> float:
    """Acceptance at ``depth`` of a drafter that reaches ``accept_ref`` at ``depth_ref``.

    Each draft position is accepted with the same probability a given that the one
    before it was, so the mean tokens per step is (1 - a^(k+1)) / (1 - a); a is fitted
    at the reference depth (bisection) and the formula evaluated at ``depth``."""
    if depth == depth_ref:
        return accept_ref
    target = min(accept_ref, depth_ref + 1 - 1e-9)

    def mean_len(a: float, k: int) -> float:
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)

    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean_len(mid, depth_ref) < target else (lo, mid)
    return mean_len((lo + hi) / 2, depth)


def slowdown(workload: str, streams: int) -> float:
    """How much longer each decode step takes with ``streams`` requests decoding at once."""
    one, two, three = CONCURRENCY_TOK_S[CONCURRENCY_CLASS.get(workload, CODE)]
    if streams <= 1:
        return 1.0
    if streams == 2:
        return one / two
    return one / three + (streams - 3) * (one / three - one / two)


@dataclass(frozen=True)
class Levers:
    """The dense-bandwidth levers a served model has."""
    fp8_shared_experts: bool = False  # the hybrid INT4+FP8 checkpoint
    int8_lm_head: bool = False  # the int8_lmhead runtime patch in the installed vLLM

    def saving_s(self) -> float:
        return FP8_SHARED_SAVING_S * self.fp8_shared_experts + INT8_LM_HEAD_SAVING_S * self.int8_lm_head


@dataclass(frozen=True)
class Speed:
    accept: float  # mean tokens per decode step (1 = no speculation)
    tok_s: float  # decode-only tokens per second at one stream


@dataclass(frozen=True)
class PerfModel:
    method: str | None  # "dflash", "mtp" (any MTP head), another speculative method, None
    k: int  # speculative tokens per step (0 = none)
    levers: Levers
    ready_delay_s: float = DEFAULT_READY_DELAY_S
    fixed_ttft_s: float | None = None  # SIM_TTFT_S
    prefill_tok_s: float = PREFILL_TOK_S
    decode_tok_s: float | None = None  # SIM_DECODE_TOK_S
    accept_len: float | None = None  # SIM_ACCEPT_LEN
    tensor_parallel: int = 1  # Sparks the model is split over (multinode.py)

    @property
    def label(self) -> str:
        dense = self.levers.fp8_shared_experts or self.levers.int8_lm_head
        if self.method is None:
            return ("dense levers, no speculation" if dense else "base") + (
                f", tp={self.tensor_parallel}" if self.tensor_parallel > 1 else "")
        tp = f", tp={self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return f"{self.method} k={self.k}" + (" + dense levers" if dense else "") + tp

    def speed(self, workload: str) -> Speed:
        """Acceptance and single-stream decode rate of ``workload`` on this profile."""
        if self.method is None or self.k <= 0:
            accept, step = 1.0, PLAIN_STEP_S - self.levers.saving_s()
        else:
            table, depth = (DFLASH_12, DFLASH_DEPTH) if self.method == "dflash" else (MTP_2, MTP_DEPTH)
            ref_accept, ref_tok_s = table[workload]
            accept = acceptance_at(ref_accept, depth, self.k)
            if self.levers.fp8_shared_experts:
                accept *= HYBRID_ACCEPT_FACTOR.get(workload, 1.0)
            ref_step = ref_accept / ref_tok_s
            step = PLAIN_STEP_S + (ref_step - PLAIN_STEP_S) * (self.k + 1) / (depth + 1)
            step -= self.levers.saving_s() * LEVER_SCALE[workload]
        step = tensor_parallel_step_s(step, self.tensor_parallel, tokens=self.k + 1)
        if self.accept_len is not None and self.method is not None and self.k > 0:
            accept = self.accept_len
        tok_s = self.decode_tok_s if self.decode_tok_s is not None else accept / step
        return Speed(accept=accept, tok_s=tok_s)

    def ttft_s(self, prompt_tokens: int) -> float:
        if self.fixed_ttft_s is not None:
            return self.fixed_ttft_s
        return TTFT_FIXED_S + prompt_tokens / self.prefill_tok_s


def _env_float(env: dict[str, str], name: str, minimum: float) -> float | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError as exc:
        raise StartupError(f"ValueError: {name}={raw!r} is not a number") from exc
    if not value >= minimum:
        raise StartupError(f"ValueError: {name}={raw!r} must be >= {minimum}")
    return value


def perf_model(method: str | None, k: int, levers: Levers, env: dict[str, str]) -> PerfModel:
    """The model for a served profile, with the ``SIM_*`` overrides of ``env`` applied."""
    accept = _env_float(env, "SIM_ACCEPT_LEN", 1.0) if method else None
    if accept is not None and accept > k + 1:
        log("WARNING", "sim", f"SIM_ACCEPT_LEN {accept} exceeds num_speculative_tokens + 1 = {k + 1}; capped")
        accept = float(k + 1)
    ready = _env_float(env, "SIM_READY_DELAY_S", 0.0)
    prefill = _env_float(env, "SIM_PREFILL_TOK_S", 1e-3)
    return PerfModel(
        method=method, k=k if method else 0, levers=levers,
        ready_delay_s=DEFAULT_READY_DELAY_S if ready is None else ready,
        fixed_ttft_s=_env_float(env, "SIM_TTFT_S", 0.0),
        prefill_tok_s=PREFILL_TOK_S if prefill is None else prefill,
        decode_tok_s=_env_float(env, "SIM_DECODE_TOK_S", 1e-3),
        accept_len=accept,
    )


# --------------------------------------------------------------------------------------
# Accepted blocks: how a request's tokens group into decode steps
# --------------------------------------------------------------------------------------
def decode_blocks(n_tokens: int, accept_len: float, k: int, steps: int | None = None) -> list[int]:
    """Sizes of the token groups a request's output arrives in.

    The first token comes alone (it is the prefill's output). The other ``n - 1`` come
    one per decode step, or under speculative decoding in ``steps`` near-equal accepted
    blocks (default: the nearest to ``(n - 1) / accept_len``), none above ``k + 1``."""
    if n_tokens <= 0:
        return []
    rest = n_tokens - 1
    if rest == 0:
        return [1]
    if k <= 0:
        return [1] * n_tokens
    if steps is None:
        steps = round(rest / accept_len)
    steps = min(max(steps, math.ceil(rest / (k + 1)), 1), rest)
    return [1] + [(i + 1) * rest // steps - i * rest // steps for i in range(steps)]


class StepPlanner:
    """Chooses each request's number of decode steps so that the engine's acceptance
    length tracks the set value across requests, short ones included (alone, a 30-token
    request can only be 29/3 or 29/4 tokens per step).

    The rounding residue is carried to the next request, so one request is within one
    step of ``(n - 1) / accept_len`` and the running total within half a step. Steps
    forced by the limits (at least one, at most k + 1 tokens each) are not carried."""

    def __init__(self, accept_len: float, k: int) -> None:
        self.accept_len, self.k = accept_len, k
        self._carry = 0.0
        self._lock = threading.Lock()

    def blocks(self, n_tokens: int) -> list[int]:
        if self.k <= 0 or n_tokens <= 1:
            return decode_blocks(n_tokens, self.accept_len, self.k)
        rest = n_tokens - 1
        with self._lock:
            wanted = rest / self.accept_len + self._carry
            blocks = decode_blocks(n_tokens, self.accept_len, self.k, steps=round(wanted))
            steps = len(blocks) - 1
            if steps == round(wanted):
                self._carry = wanted - steps
        return blocks
