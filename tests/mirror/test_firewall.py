"""The mirror's fleet-only nftables table, as rendered: nft itself must accept it."""
from __future__ import annotations

import subprocess

from sparkfleet.mirror.firewall import TABLE, rules


def test_rules_let_in_loopback_and_the_fleet_only(tmp_path) -> None:
    text = rules(["10.0.0.12", "10.0.0.13", "fd00::12"], [5000, 8090])
    assert "elements = { 10.0.0.12, 10.0.0.13 };" in text and "elements = { fd00::12 };" in text
    assert "tcp dport { 5000, 8090 } iif lo accept" in text
    assert text.rstrip().splitlines()[-3].strip() == "tcp dport { 5000, 8090 } counter reject with tcp reset"
    # Replaced in one transaction: declared, deleted, defined again.
    assert text.index(f"table inet {TABLE} {{}}") < text.index(f"delete table inet {TABLE}")
    path = tmp_path / "rules.nft"
    for sources in (["10.0.0.12", "fd00::12"], []):  # an empty set too (a fleet of one)
        path.write_text(rules(sources, [5000, 8090]))
        checked = subprocess.run(["nft", "-c", "-f", str(path)], capture_output=True, text=True)
        assert checked.returncode == 0, checked.stderr


def test_the_addresses_the_rules_allow_are_read_back(monkeypatch) -> None:
    """What keeps an unreachable host's address in the rules (a host that is down changes nothing)."""
    from sparkfleet import snapshot
    from sparkfleet.mirror import firewall

    text = rules(["10.0.0.12", "10.0.0.13", "fd00::12"], [5000, 8090])
    monkeypatch.setattr(snapshot, "text", lambda path: text if path == firewall.FIREWALL_RULES else None)
    assert firewall.current_sources() == {"10.0.0.12", "10.0.0.13", "fd00::12"}
    monkeypatch.setattr(snapshot, "text", lambda path: None)
    assert firewall.current_sources() == set()
