#!/usr/bin/env python3
"""How exact are the benches? Measured against the simulated engine's known truth.

    python3 benchmarks/bench_accuracy.py [--rate 81] [--ttft 0.25] [--accept 8.3]

Starts the simulated engine (``python -m sparkfleet.testbed.engine serve``) on 127.0.0.1 with a known decode rate,
TTFT and acceptance length (``SIM_DECODE_TOK_S``, ``SIM_TTFT_S``, ``SIM_ACCEPT_LEN``),
runs the on-host bench program exactly as a host runs it (``python3 -m`` from an
uploaded copy), and prints measured against truth:

1. decode tok/s of every workload within 2% of the true rate, TTFT reported apart;
   and the same decode rate when the TTFT is 8x longer (TTFT is excluded);
2. e2e tok/s equal to completion_tokens / wall time exactly, for every prompt, and
   close to the engine's own end-to-end time (prefill included);
3. acceptance length equal to 1 + Δaccepted / Δdrafts of the engine's own counters,
   scraped around the measured window (and close to SIM_ACCEPT_LEN).

Exit status 0 when every target is met. Numbers, not a test: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparkfleet.bench.onhost.checks import BenchContext, run_decode_workload  # noqa: E402
from sparkfleet.bench.onhost.client import Client  # noqa: E402
from sparkfleet.bench.onhost.metrics import parse_spec_counters  # noqa: E402
from sparkfleet.bench.onhost.progress import Progress  # noqa: E402
from sparkfleet.bench.onhost.schema import ProgramSettings  # noqa: E402

ENGINE_PACKAGE = "sparkfleet.testbed.engine"
ONHOST = REPO / "sparkfleet" / "bench" / "onhost"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_dir(root: Path, name: str) -> Path:
    """The least a model directory needs for the simulated engine: config + a weight file."""
    d = root / name
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "max_position_embeddings": 262144,
    }))
    (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return d


class Engine:
    """The simulated vLLM on 127.0.0.1, DFlash n=12 with the given truth."""

    def __init__(self, root: Path, rate: float, ttft: float, accept: float) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        target, drafter = model_dir(root, "target"), model_dir(root, "drafter")
        spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 12}
        env = dict(os.environ, SIM_DECODE_TOK_S=str(rate), SIM_TTFT_S=str(ttft), SIM_ACCEPT_LEN=str(accept),
                   SIM_READY_DELAY_S="0")
        env.pop("VLLM_API_KEY", None)
        self.log = open(root / f"engine-{self.port}.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", ENGINE_PACKAGE, "serve", str(target), "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", "qwen", "--speculative-config", json.dumps(spec), "--disable-log-stats"],
            env=env, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"engine exited {self.proc.returncode}: see {self.log.name}")
            try:
                urllib.request.urlopen(self.base_url + "/v1/models", timeout=1).read()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("engine did not become ready in 30 s")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def program_settings(base_url: str, out: Path, checks: list, runs: int, max_tokens: int,
                     warmup: int = 1) -> ProgramSettings:
    return ProgramSettings(
        base_url=base_url, model="qwen", checks=checks, out=str(out), run_id="accuracy", host="local",
        secrets_file="/nonexistent", runs=runs, warmup=warmup, max_tokens=max_tokens, prompt=None, state_db=None,
        agent_sessions=1, agent_max_context_tokens=16384, agent_max_tokens=200, timeout_s=600.0,
        heartbeat_s=15.0, quiet=True)


def run_program(code_root: Path, settings: ProgramSettings) -> dict:
    env = dict(os.environ, PYTHONPATH=str(code_root))
    env.pop("VLLM_API_KEY", None)
    proc = subprocess.run(
        [sys.executable, "-m", "sparkfleet_onhost", "--settings", settings.to_json()],
        env=env, capture_output=True, text=True,
    )
    out = Path(settings.out)
    if proc.returncode not in (0, 1) or not out.exists():
        raise SystemExit(f"bench program failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def verdict(ok: bool) -> str:
    return "OK  " if ok else "MISS"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=81.0, help="true decode tok/s (the reference recipe: DFlash ~81)")
    ap.add_argument("--ttft", type=float, default=0.25, help="true TTFT, seconds")
    ap.add_argument("--accept", type=float, default=8.3, help="true acceptance length (the reference recipe: 8.3)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()

    failures = 0
    with tempfile.TemporaryDirectory(prefix="sf-accuracy-") as tmp:
        root = Path(tmp)
        code_root = root / "code"
        shutil.copytree(ONHOST, code_root / "sparkfleet_onhost", ignore=shutil.ignore_patterns("__pycache__"))

        print(f"truth: decode {args.rate} tok/s, TTFT {args.ttft} s, acceptance length {args.accept} "
              f"(simulated engine, DFlash n=12), {args.max_tokens} tokens x {args.runs} runs + 1 warm-up\n")

        # 1 + 2: decode bank and albond's end-to-end method, as a host runs them
        engine = Engine(root / "e1", args.rate, args.ttft, args.accept)
        try:
            t0 = time.monotonic()
            r = run_program(code_root, program_settings(engine.base_url, root / "r1.json", ["smoke", "decode", "e2e"],
                                                        args.runs, args.max_tokens))
            elapsed = time.monotonic() - t0
            client = Client(engine.base_url, "qwen")
            # 3: acceptance against the engine's counters around one measured window
            before = parse_spec_counters(client.metrics_text())
            window = run_decode_workload(
                BenchContext(client=client, progress=Progress(quiet=True),
                             settings=program_settings(engine.base_url, root / "w.json", ["decode"], args.runs,
                                                       args.max_tokens, warmup=0)),
                "code", "Write a Python function. Begin:\n")
            after = parse_spec_counters(client.metrics_text())
        finally:
            engine.close()
        print(f"bench program: status {r['status']}, {elapsed:.1f} s\n")

        print("1. decode-only tok/s (target: within 2% of the true rate; TTFT excluded)")
        print(f"   {'workload':<10} {'median':>8} {'min':>8} {'max':>8} {'error':>8}  {'TTFT ms':>8}")
        for name, w in r["checks"]["decode"]["workloads"].items():
            d, t = w["decode_tok_s"], w["ttft_ms"]
            worst = max(abs(d["min"] / args.rate - 1), abs(d["max"] / args.rate - 1))
            ok = worst <= 0.02
            failures += not ok
            print(f"   {name:<10} {d['median']:8.2f} {d['min']:8.2f} {d['max']:8.2f} {worst * 100:7.2f}%  "
                  f"{t['median']:8.0f}  {verdict(ok)} (worst run)")

        slow_ttft = args.ttft * 8
        engine = Engine(root / "e2", args.rate, slow_ttft, args.accept)
        try:
            r_slow = run_program(code_root, program_settings(engine.base_url, root / "r2.json", ["decode"], args.runs,
                                                             args.max_tokens))
        finally:
            engine.close()
        fast = r["checks"]["decode"]["workloads"]["prose"]
        slow = r_slow["checks"]["decode"]["workloads"]["prose"]
        moved = abs(slow["decode_tok_s"]["median"] / fast["decode_tok_s"]["median"] - 1)
        ok = moved <= 0.02 and abs(slow["ttft_ms"]["median"] / 1000 - slow_ttft) < 0.05
        failures += not ok
        print(f"   TTFT {args.ttft} s -> {slow_ttft} s: decode {fast['decode_tok_s']['median']:.2f} -> "
              f"{slow['decode_tok_s']['median']:.2f} tok/s ({moved * 100:.2f}% change), measured TTFT "
              f"{fast['ttft_ms']['median']:.0f} -> {slow['ttft_ms']['median']:.0f} ms  {verdict(ok)}\n")

        print("2. albond's end-to-end method (target: tok/s == completion_tokens / wall, exactly)")
        e2e = r["checks"]["e2e"]
        print(f"   {'prompt':<9} {'tokens':>6} {'wall s':>8} {'tok/s':>8} {'recomputed':>11} {'engine e2e':>11}")
        for name, p in e2e["prompts"].items():
            recomputed = p["completion_tokens"] / p["wall_s"]
            engine_e2e = p["completion_tokens"] / (args.ttft + (p["completion_tokens"] - 1) / args.rate)
            ok = p["tok_s"] == recomputed
            failures += not ok
            print(f"   {name:<9} {p['completion_tokens']:6d} {p['wall_s']:8.3f} {p['tok_s']:8.3f} "
                  f"{recomputed:11.3f} {engine_e2e:11.3f}  {verdict(ok)}")
        mean = math.fsum(p["tok_s"] for p in e2e["prompts"].values()) / len(e2e["prompts"])
        ok = e2e["tok_s"] == mean
        failures += not ok
        print(f"   cross-prompt mean {e2e['tok_s']:.3f} tok/s (recomputed {mean:.3f})  {verdict(ok)}\n")

        print("3. acceptance length (target: equal to 1 + Δaccepted/Δdrafts of the engine's counters)")
        acc = window["acceptance"]
        d_drafts, d_acc = after.drafts - before.drafts, after.accepted - before.accepted
        truth = 1 + d_acc / d_drafts
        ok = acc["mean_length"] == truth and acc["drafts"] == d_drafts and acc["accepted"] == d_acc
        failures += not ok
        print(f"   engine counters: Δdrafts {d_drafts:.0f}, Δaccepted {d_acc:.0f} -> {truth:.4f}")
        print(f"   bench reported : drafts {acc['drafts']:.0f}, accepted {acc['accepted']:.0f} -> "
              f"{acc['mean_length']:.4f}  {verdict(ok)}")
        pp = acc.get("per_position") or []
        print(f"   per position   : {', '.join(f'{x:.2f}' for x in pp)} (sum {sum(pp):.4f} = length - 1)")
        for name, w in r["checks"]["decode"]["workloads"].items():
            print(f"   decode/{name:<9} acceptance {w['acceptance']['mean_length']:.3f} (SIM_ACCEPT_LEN {args.accept})")
        print(f"   e2e            acceptance {e2e['acceptance']['mean_length']:.3f}\n")

    print("all targets met" if not failures else f"{failures} target(s) missed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
