"""Timing math: the decode formula, TTFT kept apart, warm-up discarded, the stats."""

from __future__ import annotations

import pytest
from bench.onhost_settings import settings

from sparkfleet.bench.onhost.checks import BenchContext, run_decode_workload
from sparkfleet.bench.onhost.client import delta_kinds
from sparkfleet.bench.onhost.progress import Progress
from sparkfleet.bench.onhost.timing import (
    StreamRecord,
    TimingError,
    decode_tok_s,
    e2e_tok_s,
    record_rates,
    scaled,
    summarize,
    ttft_s,
)


def test_decode_rate_is_tokens_after_the_first_over_first_to_last_delta():
    # 101 tokens: the first at t=1.0 (prefill), the other 100 over 2 s -> 50 tok/s.
    assert decode_tok_s(101, 1.0, 3.0) == pytest.approx(50.0)


def test_ttft_does_not_enter_the_decode_rate():
    fast = StreamRecord(t_start=0.0, t_end=3.1, t_first=1.0, t_last=3.0, completion_tokens=101)
    slow_prefill = StreamRecord(t_start=-9.0, t_end=3.1, t_first=1.0, t_last=3.0, completion_tokens=101)
    a, b = record_rates(fast), record_rates(slow_prefill)
    assert a["decode_tok_s"] == b["decode_tok_s"] == pytest.approx(50.0)
    assert a["ttft_s"] == pytest.approx(1.0)
    assert b["ttft_s"] == pytest.approx(10.0)
    # ...but the end-to-end rate of the same stream does see the prefill
    assert a["e2e_tok_s"] == pytest.approx(101 / 3.1)
    assert b["e2e_tok_s"] == pytest.approx(101 / 12.1)


def test_ttft_is_first_delta_minus_request_start():
    assert ttft_s(10.0, 10.25) == pytest.approx(0.25)


@pytest.mark.parametrize(
    "tokens,first,last,match",
    [(1, 1.0, 2.0, "need 2"), (10, 1.0, 1.0, "one delta"), (10, None, None, "no generated")],
)
def test_untimeable_streams_raise(tokens, first, last, match):
    with pytest.raises(TimingError, match=match):
        decode_tok_s(tokens, first, last)


def test_e2e_is_albonds_formula_exactly():
    assert e2e_tok_s(512, 8.0) == 64.0
    assert e2e_tok_s(37, 1.3) == 37 / 1.3
    with pytest.raises(TimingError):
        e2e_tok_s(10, 0.0)


def test_summary_statistics():
    s = summarize([30.0, 10.0, 20.0, 40.0])
    assert s == {"n": 4, "median": 25.0, "mean": 25.0, "min": 10.0, "max": 40.0}
    assert summarize([]) is None
    assert summarize([1.0, float("nan"), 3.0])["n"] == 2
    assert scaled({"n": 2, "median": 0.5, "mean": 0.5, "min": 0.4, "max": 0.6}, 1000.0) == {
        "n": 2, "median": 500.0, "mean": 500.0, "min": 400.0, "max": 600.0,
    }


@pytest.mark.parametrize(
    "event,kinds",
    [
        ({"choices": [{"text": " Paris"}]}, ["text"]),
        ({"choices": [{"delta": {"content": "x"}}]}, ["content"]),
        ({"choices": [{"delta": {"reasoning_content": "hmm"}}]}, ["reasoning"]),
        ({"choices": [{"delta": {"reasoning": "hmm"}}]}, ["reasoning"]),
        ({"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": "{"}}]}}]}, ["tool_calls"]),
        ({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, []),
        ({"choices": [], "usage": {"completion_tokens": 5}}, []),
    ],
)
def test_every_kind_of_generated_delta_is_a_token_arrival(event, kinds):
    assert delta_kinds(event) == kinds


class _ScriptedClient:
    """Returns prepared stream records; counts the requests a workload makes."""

    def __init__(self, records):
        self.records = list(records)
        self.calls = []

    def stream_completion(self, prompt, max_tokens, **extra):
        self.calls.append(extra)
        return self.records.pop(0)

    def metrics_text(self):
        return ""


def _rec(rate: float, ttft: float, tokens: int = 101) -> StreamRecord:
    return StreamRecord(
        t_start=0.0, t_first=ttft, t_last=ttft + (tokens - 1) / rate,
        t_end=ttft + (tokens - 1) / rate + 0.001, completion_tokens=tokens,
    )


def test_warmup_runs_are_discarded_and_each_run_forces_the_full_budget():
    # The warm-up is 10x slower (JIT, graph capture); it must not touch the stats.
    client = _ScriptedClient([_rec(5.0, 3.0), _rec(50.0, 0.2), _rec(40.0, 0.3), _rec(60.0, 0.1)])
    ctx = BenchContext(client=client, progress=Progress(quiet=True),
                       settings=settings(runs=3, warmup=1, max_tokens=101))
    out = run_decode_workload(ctx, "prose", "prompt")
    assert out["status"] == "ok"
    assert len(out["runs"]) == 3
    assert out["decode_tok_s"]["median"] == pytest.approx(50.0)
    assert out["decode_tok_s"]["min"] == pytest.approx(40.0)
    assert out["decode_tok_s"]["max"] == pytest.approx(60.0)
    assert out["ttft_ms"]["median"] == pytest.approx(200.0)
    assert len(client.calls) == 4
    assert all(c == {"ignore_eos": True, "min_tokens": 101} for c in client.calls)


def test_a_workload_with_no_timeable_run_fails_with_the_reason():
    single = StreamRecord(t_start=0.0, t_first=0.1, t_last=0.1, t_end=0.2, completion_tokens=1)
    ctx = BenchContext(client=_ScriptedClient([single]), progress=Progress(quiet=True),
                       settings=settings(runs=1, warmup=0))
    out = run_decode_workload(ctx, "prose", "p")
    assert out["status"] == "failed"
    assert "need 2" in out["reason"]
