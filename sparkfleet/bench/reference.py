"""The reference recipe's published numbers (GB10, single stream, temperature 0), the
ones the fleet report draws and ``benchmarks/bench_seeds_table.py`` compares with.

Sources: its README's "DFlash vs MTP" and dense-bandwidth tables, its FINDINGS and its
announcement. decode/* and agent are decode-only tok/s; e2e is
albond's end-to-end method (completion tokens / wall time, prefill included).
"""

from __future__ import annotations

# profile -> workload -> (tok/s, mean acceptance length or None)
PUBLISHED: dict[str, dict[str, tuple[float, float | None]]] = {
    "base": {"decode/prose": (28.2, None), "decode/code": (28.2, None), "decode/counting": (28.2, None)},
    "dflash": {"decode/prose": (33.2, 2.3), "decode/code": (54.5, 5.4), "decode/counting": (124.5, 11.0),
               "agent": (81.0, 8.3), "e2e": (53.7, 6.5)},
    "mtp": {"decode/prose": (33.7, 2.24), "decode/code": (40.5, 2.77), "decode/counting": (43.7, 3.0),
            "agent": (39.9, 2.88)},
    "dense": {"agent": (80.0, 8.3), "e2e": (59.0, 6.4)},
    # The dense profile with speculation off (num_speculative_tokens=0): both levers, no drafter.
    "dense-nospec": {"decode/prose": (36.0, None), "decode/code": (36.0, None), "decode/counting": (36.0, None)},
}
ALBOND_PUBLISHED_E2E = 51.58  # albond's own MTP-2 stack, his method


def reference_lines() -> list:
    """The fleet report's reference lines: one per published number a bench compares with."""
    lines = [{"label": "base no-spec 28.2", "tok_s": 28.2, "workloads": "decode/"},
             {"label": f"albond MTP-2 e2e {ALBOND_PUBLISHED_E2E}", "tok_s": ALBOND_PUBLISHED_E2E, "workloads": "e2e"}]
    for profile in ("dflash", "dense"):
        for workload, (tok_s, _) in PUBLISHED[profile].items():
            name = workload.split("/")[-1]
            lines.append({"label": f"{profile} {name} {tok_s:g}", "tok_s": tok_s, "workloads": workload})
    return lines
