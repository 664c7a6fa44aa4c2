"""``/metrics`` in Prometheus text with vLLM's names and labels, and the counters behind it.

Each decode step after the first token is one draft; a step that yields b tokens adds 1
to ``spec_decode_num_drafts``, b - 1 to ``num_accepted_tokens`` (positions 0..b-2 to the
per-position counters) and k to ``num_draft_tokens``, so 1 + accepted / drafts is the
acceptance length the benches read.
"""
from __future__ import annotations

import threading

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


class _Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.total = 0.0
        self.n = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.n += 1


def _fmt(value: float) -> str:
    return repr(float(value))


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class Metrics:
    def __init__(self, model_name: str, num_spec_tokens: int) -> None:
        self.labels = f'engine="0",model_name="{_label_value(model_name)}"'
        self.k = num_spec_tokens
        self.lock = threading.Lock()
        self.running = 0
        self.waiting = 0
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0] * num_spec_tokens

    def decode_step(self, block: int) -> None:
        """One verification step that yielded ``block`` tokens (block - 1 accepted)."""
        with self.lock:
            self.generation_tokens += block
            if self.k:
                accepted = block - 1
                self.drafts += 1
                self.draft_tokens += self.k
                self.accepted += accepted
                for pos in range(accepted):
                    self.accepted_per_pos[pos] += 1

    def render(self) -> str:
        lb = self.labels
        out: list[str] = []

        def metric(name: str, kind: str, doc: str, samples: list[tuple[str, str, float]]) -> None:
            out.append(f"# HELP {name} {doc}")
            out.append(f"# TYPE {name} {kind}")
            for suffix, labels, value in samples:
                out.append(f"{name}{suffix}{{{labels}}} {_fmt(value)}")

        def histogram(name: str, doc: str, h: _Histogram) -> None:
            samples = [("_bucket", f'{lb},le="{b}"', c) for b, c in zip(h.buckets, h.counts)]
            samples += [("_bucket", f'{lb},le="+Inf"', h.n), ("_count", lb, h.n), ("_sum", lb, h.total)]
            metric(name, "histogram", doc, samples)

        with self.lock:
            metric("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                   [("", lb, self.running)])
            metric("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                   [("", lb, self.waiting)])
            metric("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.",
                   [("", lb, min(1.0, 0.01 * self.running))])
            metric("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                   [("", lb, self.prompt_tokens)])
            metric("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                   [("", lb, self.generation_tokens)])
            metric("vllm:request_success_total", "counter", "Count of successfully processed requests.",
                   [("", f'{lb},finished_reason="{r}"', c) for r, c in self.success.items()])
            histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", self.ttft)
            histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", self.e2e)
            if self.k:
                metric("vllm:spec_decode_num_drafts_total", "counter", "Number of spec decoding drafts.",
                       [("", lb, self.drafts)])
                metric("vllm:spec_decode_num_draft_tokens_total", "counter", "Number of draft tokens.",
                       [("", lb, self.draft_tokens)])
                metric("vllm:spec_decode_num_accepted_tokens_total", "counter", "Number of accepted tokens.",
                       [("", lb, self.accepted)])
                metric("vllm:spec_decode_num_accepted_tokens_per_pos_total", "counter",
                       "Accepted tokens per draft position.",
                       [("", f'{lb},position="{p}"', c) for p, c in enumerate(self.accepted_per_pos)])
        return "\n".join(out) + "\n"


