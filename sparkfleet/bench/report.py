"""Fleet report: every host's check results side by side, against the reference recipe's
published numbers (``reference.py``).

    sparkfleet report results/<run-id>      (sparkfleet.cli calls main([...]))

Reads ``results/<run-id>/<host>.json`` and writes, next to them:

- ``fleet-report.txt`` — the terminal table (also printed): per workload, each host's
  tok/s, TTFT and mean acceptance length, and how far it is from the fleet median;
- ``fleet-report.csv`` / ``fleet-report.json`` — the same, for machines;
- ``fleet-report.png`` — tok/s per workload and host, with the published numbers drawn
  as reference lines.

A host more than 10% below the fleet median of a workload is flagged. A host that failed
its checks is shown as failed, with the reason (and the smoke answer it gave).
"""

from __future__ import annotations

import argparse
import csv
import io
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sparkfleet.bench.onhost.schema import now_iso
from sparkfleet.bench.reference import reference_lines
from sparkfleet.bench.results import REPORT_STEM, load_run, write_json

# A host this far below the fleet median of a workload is flagged.
FLAG_BELOW_MEDIAN = 0.10

# The reference recipe's published numbers, drawn beside the workloads they compare with.
REFERENCES: list[dict] = reference_lines()

_WORKLOAD_ORDER = ["decode/prose", "decode/code", "decode/counting", "decode/user", "e2e", "agent"]
_WORKLOAD_TITLES = {"e2e": "e2e (albond)", "agent": "agent (Hermes)"}


@dataclass
class Cell:
    tok_s: float | None
    ttft_ms: float | None
    acceptance: float | None
    status: str = "ok"
    reason: str | None = None
    median: float | None = None
    vs_median: float | None = None  # fraction: -0.12 is 12% below the median
    flagged: bool = False


@dataclass
class HostRow:
    host: str
    status: str
    reason: str | None
    smoke: dict | None
    tools: dict | None
    cells: dict[str, Cell] = field(default_factory=dict)


@dataclass
class FleetReport:
    run_dir: Path
    run_id: str
    hosts: list[HostRow]
    workloads: list[str]
    medians: dict[str, float | None]

    @property
    def failed(self) -> list[HostRow]:
        return [h for h in self.hosts if h.status != "ok"]

    @property
    def flagged(self) -> list[tuple]:
        return [(h.host, w, c) for w in self.workloads for h in self.hosts
                for c in [h.cells.get(w)] if c is not None and c.flagged]


# --- from results to cells ------------------------------------------------------------------


def _median_of(summary: dict | None) -> float | None:
    return summary.get("median") if isinstance(summary, dict) else None


def _acceptance(check: dict) -> float | None:
    acc = check.get("acceptance")
    return acc.get("mean_length") if isinstance(acc, dict) else None


def host_cells(result: dict) -> dict[str, Cell]:
    """The workload cells of one host's result (decode bank, e2e, agent)."""
    checks = result.get("checks") or {}
    cells: dict[str, Cell] = {}
    decode = checks.get("decode") or {}
    for name, w in (decode.get("workloads") or {}).items():
        cells[f"decode/{name}"] = Cell(
            tok_s=_median_of(w.get("decode_tok_s")), ttft_ms=_median_of(w.get("ttft_ms")),
            acceptance=_acceptance(w), status=w.get("status", "ok"), reason=w.get("reason"),
        )
    if not decode.get("workloads") and decode:
        cells["decode/prose"] = Cell(None, None, None, decode.get("status", "failed"), decode.get("reason"))
    e2e = checks.get("e2e")
    if e2e:
        cells["e2e"] = Cell(
            tok_s=e2e.get("tok_s"), ttft_ms=None, acceptance=_acceptance(e2e),
            status=e2e.get("status", "ok"), reason=e2e.get("reason"),
        )
    agent = checks.get("agent")
    if agent:
        cells["agent"] = Cell(
            tok_s=_median_of(agent.get("decode_tok_s")), ttft_ms=_median_of(agent.get("ttft_ms")),
            acceptance=_acceptance(agent), status=agent.get("status", "ok"), reason=agent.get("reason"),
        )
    return cells


def _workload_sort_key(name: str) -> tuple:
    return (_WORKLOAD_ORDER.index(name) if name in _WORKLOAD_ORDER else len(_WORKLOAD_ORDER), name)


def build(run_dir: Path) -> FleetReport:
    run_dir = Path(run_dir)
    results = load_run(run_dir)
    rows = [
        HostRow(
            host=name, status=r.get("status", "failed"), reason=r.get("reason"),
            smoke=(r.get("checks") or {}).get("smoke"), tools=(r.get("checks") or {}).get("tools"),
            cells=host_cells(r),
        )
        for name, r in sorted(results.items())
    ]
    workloads = sorted({w for row in rows for w in row.cells}, key=_workload_sort_key)
    medians: dict[str, float | None] = {}
    for w in workloads:
        values = [row.cells[w].tok_s for row in rows if w in row.cells and row.cells[w].tok_s is not None]
        medians[w] = statistics.median(values) if values else None
        for row in rows:
            cell = row.cells.get(w)
            if cell is None or cell.tok_s is None or not medians[w]:
                continue
            cell.median = medians[w]
            cell.vs_median = cell.tok_s / medians[w] - 1.0
            cell.flagged = cell.tok_s < (1.0 - FLAG_BELOW_MEDIAN) * medians[w]
    run_id = next((r.get("run_id") for r in results.values() if r.get("run_id")), run_dir.name)
    return FleetReport(run_dir=run_dir, run_id=str(run_id), hosts=rows, workloads=workloads, medians=medians)


# --- renderings -------------------------------------------------------------------------------------


def _num(value: float | None, fmt: str) -> str:
    width = int(fmt.split(".")[0] or 0)
    return f"{'-':>{width}}" if value is None else format(value, fmt)


def render_table(rep: FleetReport) -> str:
    ok = len(rep.hosts) - len(rep.failed)
    out = io.StringIO()
    out.write(
        f"sparkfleet fleet report · run {rep.run_id} · {len(rep.hosts)} host(s): "
        f"{ok} ok, {len(rep.failed)} failed · {rep.run_dir}\n\n"
    )
    host_w = max([len("host")] + [len(h.host) for h in rep.hosts])
    wl_w = max([len("workload")] + [len(_WORKLOAD_TITLES.get(w, w)) for w in rep.workloads])
    header = f"{'workload':<{wl_w}}  {'host':<{host_w}}  {'tok/s':>8}  {'TTFT ms':>8}  {'accept':>6}  {'vs median':>9}"
    out.write(header + "\n" + "-" * len(header) + "\n")
    for w in rep.workloads:
        first = True
        for row in rep.hosts:
            cell = row.cells.get(w)
            title = _WORKLOAD_TITLES.get(w, w) if first else ""
            if cell is None:
                if row.status != "ok":
                    out.write(f"{title:<{wl_w}}  {row.host:<{host_w}}  {'FAILED':>8}\n")
                    first = False
                continue
            first = False
            if cell.tok_s is None:
                status = "SKIPPED" if cell.status == "skipped" else "FAILED"
                out.write(f"{title:<{wl_w}}  {row.host:<{host_w}}  {status:>8}  {cell.reason or ''}\n")
                continue
            vs = "" if cell.vs_median is None else f"{cell.vs_median * 100:+.1f}%"
            flag = f"  << FLAG: more than {FLAG_BELOW_MEDIAN:.0%} below the fleet median" if cell.flagged else ""
            out.write(
                f"{title:<{wl_w}}  {row.host:<{host_w}}  {_num(cell.tok_s, '8.2f')}  "
                f"{_num(cell.ttft_ms, '8.0f')}  {_num(cell.acceptance, '6.2f')}  {vs:>9}{flag}\n"
            )
        if rep.medians.get(w) is not None:
            out.write(f"{'':<{wl_w}}  {'median':<{host_w}}  {rep.medians[w]:8.2f}\n")
        published = [r["label"] for r in REFERENCES if w.startswith(r["workloads"])]
        if published:
            out.write(f"{'':<{wl_w}}  {'published':<{host_w}}  {' · '.join(published)}\n")
    smoke_rows = [h for h in rep.hosts if h.smoke]
    if smoke_rows:
        out.write("\nsmoke (capital of France):\n")
        for h in smoke_rows:
            verdict = "PASS" if h.smoke.get("passed") else "FAIL"
            out.write(f"  {h.host:<{host_w}}  {verdict}  answer {str(h.smoke.get('answer', ''))!r}\n")
    tools_rows = [h for h in rep.hosts if h.tools]
    if tools_rows:
        out.write("\ntools (function-call round trip):\n")
        for h in tools_rows:
            if h.tools.get("passed"):
                detail = f"get_weather({h.tools.get('arguments')}) -> answered"
            else:
                detail = str(h.tools.get("reason") or h.tools.get("status"))
            out.write(f"  {h.host:<{host_w}}  {'PASS' if h.tools.get('passed') else 'FAIL'}  {detail}\n")
    if rep.failed:
        out.write("\nfailed hosts:\n")
        for h in rep.failed:
            out.write(f"  {h.host:<{host_w}}  FAILED  {h.reason}\n")
    if rep.flagged:
        out.write("\nflagged (more than 10% below the fleet median):\n")
        for host, w, c in rep.flagged:
            out.write(f"  {host} on {w}: {c.tok_s:.2f} tok/s vs median {c.median:.2f} ({c.vs_median * 100:+.1f}%)\n")
    out.write(
        "\nreferences (the reference recipe, GB10, c=1): " + " · ".join(r["label"] for r in REFERENCES) + "\n"
        "decode/* and agent are decode-only tok/s (TTFT excluded); e2e is albond's "
        "completion_tokens / wall time.\n"
    )
    return out.getvalue()


CSV_FIELDS = [
    "run_id", "host", "host_status", "workload", "status", "tok_s", "ttft_ms", "acceptance",
    "fleet_median_tok_s", "vs_median_pct", "flagged", "reason",
]


def render_csv(rep: FleetReport) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_FIELDS, lineterminator="\n")
    writer.writeheader()
    for row in rep.hosts:
        if not row.cells:
            writer.writerow({"run_id": rep.run_id, "host": row.host, "host_status": row.status,
                             "workload": "", "status": row.status, "flagged": False, "reason": row.reason or ""})
        for w in rep.workloads:
            cell = row.cells.get(w)
            if cell is None:
                continue
            writer.writerow({
                "run_id": rep.run_id, "host": row.host, "host_status": row.status, "workload": w,
                "status": cell.status,
                "tok_s": "" if cell.tok_s is None else f"{cell.tok_s:.4f}",
                "ttft_ms": "" if cell.ttft_ms is None else f"{cell.ttft_ms:.1f}",
                "acceptance": "" if cell.acceptance is None else f"{cell.acceptance:.4f}",
                "fleet_median_tok_s": "" if cell.median is None else f"{cell.median:.4f}",
                "vs_median_pct": "" if cell.vs_median is None else f"{cell.vs_median * 100:.2f}",
                "flagged": cell.flagged,
                "reason": cell.reason or "",
            })
    return out.getvalue()


def render_json(rep: FleetReport) -> dict:
    return {
        "run_id": rep.run_id,
        "generated_at": now_iso(),
        "flag_below_median": FLAG_BELOW_MEDIAN,
        "references": REFERENCES,
        "workloads": {w: {"median_tok_s": rep.medians.get(w)} for w in rep.workloads},
        "hosts": {
            h.host: {
                "status": h.status,
                "reason": h.reason,
                "smoke": h.smoke,
                "tools": h.tools,
                "workloads": {w: vars(c) for w, c in h.cells.items()},
            }
            for h in rep.hosts
        },
        "failed": [h.host for h in rep.failed],
        "flagged": [
            {"host": host, "workload": w, "tok_s": c.tok_s, "median": c.median, "vs_median": c.vs_median}
            for host, w, c in rep.flagged
        ],
    }


def _spread(values: list[float], gap: float) -> list[float]:
    """Label heights near ``values``, at least ``gap`` apart (so labels do not overlap)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = list(values)
    for prev, cur in zip(order, order[1:]):
        out[cur] = max(out[cur], out[prev] + gap)
    return out


def render_png(rep: FleetReport, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on a controller or in CI
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    workloads = rep.workloads or ["(no results)"]
    hosts = rep.hosts
    n = max(len(hosts), 1)
    width = 0.8 / n
    fig, ax = plt.subplots(figsize=(max(9.0, 1.2 * len(workloads) * max(1.0, n / 3) + 3.0), 5.4))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    values = [c.tok_s for h in hosts for c in h.cells.values() if c.tok_s]
    top = max([r["tok_s"] for r in REFERENCES] + values) * 1.3
    handles: list = []
    for i, row in enumerate(hosts):
        xs, ys, edge = [], [], []
        for gi, w in enumerate(workloads):
            cell = row.cells.get(w)
            x = gi - 0.4 + width * (i + 0.5)
            if cell is None or cell.tok_s is None:
                if row.status != "ok" or cell is not None:
                    ax.text(x, top * 0.01, "failed", rotation=90, ha="center", va="bottom",
                            fontsize=7, color="#b00020")
                continue
            xs.append(x)
            ys.append(cell.tok_s)
            edge.append("#b00020" if cell.flagged else "none")
            label = f"{cell.tok_s:.1f}" + (f"  acc {cell.acceptance:.1f}" if cell.acceptance else "")
            ax.text(x, cell.tok_s + top * 0.01, ("! " if cell.flagged else "") + label, rotation=90,
                    ha="center", va="bottom", fontsize=6, color="#b00020" if cell.flagged else "black")
        failed = row.status != "ok"
        color = "#bbbbbb" if failed else colors[i % len(colors)]
        ax.bar(xs, ys, width=width * 0.95, color=color, edgecolor=edge, linewidth=2,
               hatch="//" if failed else None)
        # Explicit legend entries: a failed host often has no bar to take a colour from.
        handles.append(Patch(facecolor=color, hatch="//" if failed else None,
                             label=row.host + (" (failed)" if failed else "")))
    # Reference lines over the workloads they compare with; labels in the right margin.
    right = len(workloads) - 0.5
    # Only the references of workloads this run measured: the others have nothing to compare.
    shown = [r for r in REFERENCES if any(w.startswith(r["workloads"]) for w in workloads)] or REFERENCES
    label_y = _spread([r["tok_s"] for r in shown], top * 0.035)
    for ref, y_label in zip(shown, label_y):
        groups = [gi for gi, w in enumerate(workloads) if w.startswith(ref["workloads"])]
        lo, hi = (min(groups) - 0.45, max(groups) + 0.45) if groups else (-0.5, right)
        ax.hlines(ref["tok_s"], lo, hi, colors="#444444", linestyles="dashed", linewidth=1.2)
        ax.plot([hi, right + 0.1], [ref["tok_s"], y_label], color="#999999", linestyle=":", linewidth=0.8)
        ax.text(right + 0.12, y_label, ref["label"], va="center", ha="left", fontsize=7, color="#333333")
    ax.set_xticks(range(len(workloads)))
    ax.set_xticklabels([_WORKLOAD_TITLES.get(w, w) for w in workloads], fontsize=8)
    ax.set_xlim(-0.6, right + 1.35)  # room for the reference labels
    ax.set_ylim(0, top)
    ax.set_ylabel("tok/s (decode-only; e2e: albond end-to-end)")
    failed_names = f" · failed: {', '.join(h.host for h in rep.failed)}" if rep.failed else ""
    ax.set_title(f"sparkfleet run {rep.run_id}: {len(hosts)} host(s){failed_names}", fontsize=10)
    ax.legend(handles=handles, fontsize=7, loc="upper left")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- entry points ----------------------------------------------------------------------------------


def write(rep: FleetReport, plot: bool = True) -> dict[str, Path]:
    """Write the report files next to the results; returns their paths."""
    paths = {ext: rep.run_dir / f"{REPORT_STEM}.{ext}" for ext in ("txt", "csv", "json", "png")}
    paths["txt"].write_text(render_table(rep), encoding="utf-8")
    paths["csv"].write_text(render_csv(rep), encoding="utf-8")
    write_json(paths["json"], render_json(rep))
    if plot:
        render_png(rep, paths["png"])
    else:
        paths.pop("png")
    return paths


def write_and_print(run_dir: Path, plot: bool = True, stream=None) -> FleetReport:
    rep = build(Path(run_dir))
    paths = write(rep, plot=plot)
    stream = stream or sys.stdout
    stream.write("\n" + render_table(rep))
    stream.write("report files: " + ", ".join(str(p) for p in paths.values()) + "\n")
    stream.flush()
    return rep


def main(argv: Sequence[str] | None = None) -> int:
    """``sparkfleet report RESULTS/RUN_ID``: rebuild the fleet report from saved results.

    Exit status 0 when written, 1 with ``--strict`` when a host failed or was flagged,
    2 when the directory holds no results.
    """
    ap = argparse.ArgumentParser(prog="sparkfleet report", description="Rebuild the fleet report from saved results.")
    ap.add_argument("run_dir", help="results/<run-id>, as written by the checks")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNG")
    ap.add_argument("--strict", action="store_true", help="exit 1 when a host failed or was flagged")
    args = ap.parse_args(list(argv) if argv is not None else None)
    directory = Path(args.run_dir)
    if not directory.is_dir() or not load_run(directory):
        print(f"sparkfleet report: no host results in {directory} (expected <host>.json files "
              "written by checks/bench.py or deploy.py --data checks=...)", file=sys.stderr)
        return 2
    rep = write_and_print(directory, plot=not args.no_plot)
    if args.strict and (rep.failed or rep.flagged):
        return 1
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
