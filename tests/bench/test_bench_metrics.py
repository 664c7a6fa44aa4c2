"""/metrics parsing (prometheus_client's parser) and acceptance length from deltas."""

from __future__ import annotations

import pytest

from sparkfleet.bench.onhost.metrics import SpecCounters, acceptance, parse_spec_counters


def _exposition(drafts, draft_tokens, accepted, per_pos, engines=("0",)):
    """vLLM's exposition as prometheus_client writes it (HELP/TYPE, _total, _created)."""
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="qwen"} 1.0',
    ]
    for name, value in (
        ("vllm:spec_decode_num_drafts", drafts),
        ("vllm:spec_decode_num_draft_tokens", draft_tokens),
        ("vllm:spec_decode_num_accepted_tokens", accepted),
    ):
        lines += [f"# HELP {name}_total x", f"# TYPE {name}_total counter"]
        for e in engines:
            # label order and an escaped quote in a label value: a parser's job, not a regex's
            lines.append(f'{name}_total{{model_name="qwen \\"a\\"",engine="{e}"}} {value}')
        lines += [f"# HELP {name}_created x", f"# TYPE {name}_created gauge"]
        for e in engines:
            lines.append(f'{name}_created{{engine="{e}",model_name="qwen"}} 1.7e+09')
    lines += ["# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total x",
              "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter"]
    for e in engines:
        for pos, value in enumerate(per_pos):
            lines.append(
                f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="{e}",model_name="qwen",position="{pos}"}} {value}'
            )
    return "\n".join(lines) + "\n"


def test_counters_are_summed_over_label_sets_and_created_is_ignored():
    c = parse_spec_counters(_exposition(10, 120, 73, [9, 8, 7], engines=("0", "1")))
    assert c.present
    assert (c.drafts, c.draft_tokens, c.accepted) == (20.0, 240.0, 146.0)
    assert c.accepted_per_pos == {0: 18.0, 1: 16.0, 2: 14.0}


def test_acceptance_length_from_deltas():
    before = parse_spec_counters(_exposition(100, 1200, 500, [90, 80, 70]))
    after = parse_spec_counters(_exposition(300, 3600, 2150, [280, 250, 220]))
    acc = acceptance(after - before)
    # 1 + (2150 - 500) / (300 - 100)
    assert acc["mean_length"] == pytest.approx(1 + 1650 / 200)
    assert acc["rate"] == pytest.approx(1650 / 2400)
    assert acc["drafts"] == 200 and acc["accepted"] == 1650
    assert acc["per_position"] == pytest.approx([190 / 200, 170 / 200, 150 / 200])


def test_per_position_rates_sum_to_mean_length_minus_one_when_complete():
    # When every accepted token is counted at its position, the identity holds.
    before = parse_spec_counters(_exposition(0, 0, 0, [0, 0, 0]))
    after = parse_spec_counters(_exposition(10, 30, 17, [8, 6, 3]))
    acc = acceptance(after - before)
    assert sum(acc["per_position"]) == pytest.approx(acc["mean_length"] - 1)


def test_a_server_without_a_drafter_has_no_acceptance():
    text = "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    c = parse_spec_counters(text)
    assert not c.present
    assert acceptance(c - c) is None


def test_no_draft_in_the_window_means_no_acceptance():
    same = parse_spec_counters(_exposition(5, 60, 20, [3, 2]))
    assert acceptance(same - same) is None


def test_per_position_may_be_missing():
    text = (
        "# TYPE vllm:spec_decode_num_drafts_total counter\nvllm:spec_decode_num_drafts_total 4\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\nvllm:spec_decode_num_accepted_tokens_total 6\n"
    )
    acc = acceptance(parse_spec_counters(text) - SpecCounters(present=True))
    assert acc["mean_length"] == pytest.approx(2.5)
    assert acc["per_position"] is None
    assert acc["rate"] is None  # no draft-token counter to divide by
