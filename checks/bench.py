"""Benchmark every host against its own server, in parallel, and write the fleet report.

    pyinfra inventory/sparks.py checks/bench.py --data bench=decode,e2e,agent \
        [--data agent_state_db=~/.hermes/state.db] [--data run_id=NAME]

bench (default smoke,decode,e2e) is any of:
  smoke   the capital-of-France answer
  tools   a function-call round trip (a declared function called, its result answered)
  decode  decode-only tok/s on the reference recipe's bank (prose, code, counting, + bench_prompt)
  e2e     albond's end-to-end tok/s (5 prompts, pass 1 discarded; compare with 51.58)
  agent   decode-only tok/s regenerating real Hermes turns from agent_state_db (~81)
Each reports speculative acceptance from /metrics. Results land in
results/<run-id>/<host>.json; the report (txt, csv, json, png) beside them.
Rebuild it later with `sparkfleet report results/<run-id>`.
"""

from sparkfleet.bench.deploy import run_checks
from sparkfleet.fleet import fleet_settings

run_checks(fleet_settings(locked=False).bench)  # the checks read no image and no weights
