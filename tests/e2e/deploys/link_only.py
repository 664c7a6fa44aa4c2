"""The pair link alone, as deploy.py runs it: every host validated, the preflight's link
findings (a pair's: a member whose peer fails stops too), netplan, and the link checked
end to end (tests/e2e/test_pair_link.py).

    pyinfra -y INVENTORY tests/e2e/deploys/link_only.py
"""

from sparkfleet import link, preflight
from sparkfleet.config import Settings
from sparkfleet.fleet import fleet_settings, host_pair


def link_findings(settings: Settings) -> preflight.Findings:
    """A member's link problems, as the full preflight judges them (host_pair() of the host judged)."""
    pair = host_pair()
    return preflight.Findings(problems=link.problems(settings, pair), summary=f"{pair.group} rank {pair.rank}")


settings = fleet_settings()
pair = host_pair()

if pair:
    findings = preflight.inspect(settings, judge=link_findings)
    preflight.passed(name="preflight: the ConnectX-7 link", findings=findings)
    if findings.passed:
        link.configured(settings, pair)
        link.checked(name="the link answers end to end", settings=settings, pair=pair)
