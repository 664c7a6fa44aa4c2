"""Speculative-decoding acceptance from vLLM's ``/metrics`` counters.

vLLM (v1 engine) exports, as Prometheus counters:

- ``vllm:spec_decode_num_drafts_total``          one per verify step that had a draft
- ``vllm:spec_decode_num_draft_tokens_total``    tokens proposed by the drafter
- ``vllm:spec_decode_num_accepted_tokens_total`` proposed tokens the target accepted
- ``vllm:spec_decode_num_accepted_tokens_per_pos_total{position="i"}`` accepted at position i

A bench scrapes before and after its measured window; the acceptance of that window is
computed from the deltas: mean acceptance length = 1 + Δaccepted / Δdrafts (the 1 is the
token the target produces itself each step), per-position rate i = Δaccepted_i / Δdrafts.

The text is parsed with ``prometheus_client.parser`` — label order, escaping, ``_created``
companions and several engines' label sets are its business, not a regex's. Samples
that differ only by labels (``engine``, ``model_name``) are summed: one server, one total.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

DRAFTS = "vllm:spec_decode_num_drafts"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


@dataclass
class SpecCounters:
    """The speculative-decoding counters at one instant (or a difference of two)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict = field(default_factory=dict)  # position (int) -> count
    # False when the server exports none of the counters (no speculative decoder).
    present: bool = False

    def __sub__(self, before: "SpecCounters") -> "SpecCounters":
        positions = set(self.accepted_per_pos) | set(before.accepted_per_pos)
        return SpecCounters(
            drafts=self.drafts - before.drafts,
            draft_tokens=self.draft_tokens - before.draft_tokens,
            accepted=self.accepted - before.accepted,
            accepted_per_pos={
                p: self.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0)
                for p in sorted(positions)
            },
            present=self.present and before.present,
        )


def _is_counter_sample(sample_name: str, base: str) -> bool:
    # Counters are exposed as NAME_total (and NAME_created, which is a timestamp, not a
    # count); tolerate an exporter that drops the suffix.
    return sample_name in (base + "_total", base)


def parse_spec_counters(text: str) -> SpecCounters:
    """Sum vLLM's speculative-decoding counters out of a Prometheus text exposition."""
    out = SpecCounters()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name
            if _is_counter_sample(name, DRAFTS):
                out.drafts += sample.value
                out.present = True
            elif _is_counter_sample(name, DRAFT_TOKENS):
                out.draft_tokens += sample.value
                out.present = True
            elif _is_counter_sample(name, ACCEPTED):
                out.accepted += sample.value
                out.present = True
            elif _is_counter_sample(name, ACCEPTED_PER_POS):
                raw = sample.labels.get("position")
                if raw is None:
                    continue
                pos = int(raw)
                out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + sample.value
                out.present = True
    return out


def acceptance(delta: SpecCounters) -> dict | None:
    """Acceptance of a measured window, or None when no draft happened in it.

    ``mean_length`` is what the reference recipe calls "accept len" (1 + accepted / drafts);
    ``rate`` is accepted / proposed; ``per_position[i]`` is accepted at i / drafts, so the
    per-position rates add up to mean_length - 1.
    """
    if not delta.present or delta.drafts <= 0:
        return None
    return {
        "mean_length": 1.0 + delta.accepted / delta.drafts,
        "rate": (delta.accepted / delta.draft_tokens) if delta.draft_tokens > 0 else None,
        "drafts": delta.drafts,
        "draft_tokens": delta.draft_tokens,
        "accepted": delta.accepted,
        "per_position": [
            delta.accepted_per_pos[p] / delta.drafts for p in sorted(delta.accepted_per_pos)
        ]
        or None,
    }
