"""Timing math of the benches: pure functions over timestamps, no I/O.

Two methods from the reference recipe, kept apart on purpose because they answer different
questions and are not comparable:

- decode-only (``bench_decode.py``): tok/s = (tokens - 1) / (t_last - t_first), where
  t_first / t_last are the arrival times of the first and last *generated* delta of a
  streamed response. The first token is the product of prefill, so it and the time to
  it (TTFT) are excluded and TTFT is reported on its own.
- end-to-end (albond's ``bench_qwen35.sh``): tok/s = completion_tokens / wall time of a
  whole non-streaming request, prefill and overhead included.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field


@dataclass
class StreamRecord:
    """What one streamed request looked like from the client side.

    Times are ``time.perf_counter()`` seconds; ``t_first``/``t_last`` are None when no
    generated delta arrived at all.
    """

    t_start: float
    t_end: float
    t_first: float | None
    t_last: float | None
    completion_tokens: int
    prompt_tokens: int | None = None
    deltas: int = 0
    # Deltas seen per kind: content, reasoning, tool_calls (chat) or text (completions).
    kinds: dict = field(default_factory=dict)
    # "usage" when the server reported completion_tokens, "deltas" when we had to count.
    tokens_source: str = "usage"


class TimingError(ValueError):
    """A response too short or too degenerate to time."""


def decode_tok_s(tokens: int, t_first: float | None, t_last: float | None) -> float:
    """Decode-only rate: the tokens after the first over the time between first and last delta."""
    if t_first is None or t_last is None:
        raise TimingError("no generated delta arrived")
    if tokens < 2:
        raise TimingError(f"{tokens} token(s) cannot give a decode rate (need 2 or more)")
    span = t_last - t_first
    if span <= 0:
        raise TimingError(
            f"all {tokens} tokens arrived in one delta; raise max_tokens or check the stream"
        )
    return (tokens - 1) / span


def ttft_s(t_start: float, t_first: float | None) -> float:
    """Time to first generated delta, measured from just before the request was sent."""
    if t_first is None:
        raise TimingError("no generated delta arrived")
    return t_first - t_start


def e2e_tok_s(completion_tokens: int, wall_s: float) -> float:
    """albond's end-to-end rate: completion tokens over the whole request's wall time."""
    if wall_s <= 0:
        raise TimingError("non-positive wall time")
    return completion_tokens / wall_s


def record_rates(rec: StreamRecord) -> dict:
    """Decode rate, TTFT and end-to-end rate of one streamed request (raises TimingError)."""
    wall = rec.t_end - rec.t_start
    return {
        "completion_tokens": rec.completion_tokens,
        "prompt_tokens": rec.prompt_tokens,
        "decode_tok_s": decode_tok_s(rec.completion_tokens, rec.t_first, rec.t_last),
        "ttft_s": ttft_s(rec.t_start, rec.t_first),
        "e2e_tok_s": e2e_tok_s(rec.completion_tokens, wall),
        "wall_s": wall,
        "decode_span_s": (rec.t_last or 0.0) - (rec.t_first or 0.0),
        "deltas": rec.deltas,
        "kinds": dict(rec.kinds),
        "tokens_source": rec.tokens_source,
    }


def summarize(values: Iterable[float]) -> dict | None:
    """n / median / mean / min / max of the measured runs, or None when there are none."""
    vals = [float(v) for v in values if v is not None and not math.isnan(v)]
    if not vals:
        return None
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "mean": statistics.fmean(vals),
        "min": min(vals),
        "max": max(vals),
    }


def scaled(summary: dict | None, factor: float) -> dict | None:
    """The same summary in other units (e.g. seconds -> milliseconds)."""
    if summary is None:
        return None
    return {k: (v if k == "n" else v * factor) for k, v in summary.items()}


def as_dict(rec: StreamRecord) -> dict:
    return asdict(rec)
