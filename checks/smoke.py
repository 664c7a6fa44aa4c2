"""Smoke-check every host: does its server answer "Paris"?

    pyinfra inventory/sparks.py checks/smoke.py [--data run_id=NAME]

POST /v1/completions "What is the capital of France? Answer in one word.", 8 tokens,
temperature 0, against the host's own port with its API key. A host whose answer lacks
"Paris" fails and is reported with the answer it gave. Results: results/<run-id>/.
"""

from sparkfleet.bench.deploy import run_checks

run_checks(["smoke"])
