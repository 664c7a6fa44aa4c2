"""The pair link alone, as deploy.py runs it: every host validated, the preflight's link
findings, netplan, and the link checked end to end (tests/e2e/test_pair_link.py).

    pyinfra -y INVENTORY tests/e2e/deploys/link_only.py
"""

from sparkfleet import link, preflight
from sparkfleet.config import fleet_settings, host_pair

settings = fleet_settings()
pair = host_pair()

if pair:
    findings = preflight.Findings(problems=link.problems(settings, pair), summary=f"{pair.group} rank {pair.rank}")
    preflight.passed(name="preflight: the ConnectX-7 link", findings=findings)
    if not findings.problems:
        link.configured(settings, pair)
        link.checked(name="the link answers end to end", settings=settings, pair=pair)
