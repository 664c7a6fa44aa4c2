"""One key's value judged alone, outside any host's settings (no fleet)."""

from __future__ import annotations

import pytest
from pydantic import TypeAdapter, ValidationError

from sparkfleet import values


def judged(kind, value):
    return TypeAdapter(kind).validate_python(value)


def test_a_role_is_off_by_any_of_its_words_and_otherwise_one_host_name():
    for off in (None, False, "", "  ", " None ", "off", "false"):
        assert judged(values.RoleHost, off) is None
    assert judged(values.RoleHost, "auto") == "auto"
    for bad in (3, "a\nb", ["x"]):
        with pytest.raises(ValidationError, match="must be 'auto', a host name of the inventory, or none"):
            judged(values.RoleHost, bad)


def test_a_comma_list_is_a_list_and_the_names_in_it_are_checked():
    assert judged(values.CheckNames, "smoke, decode,") == ["smoke", "decode"]
    assert judged(values.LockUpdate, "image,org/model") == ["image", "org/model"]
    with pytest.raises(ValidationError, match="unknown check"):
        judged(values.CheckNames, "smoke,nope")
    with pytest.raises(ValidationError, match="neither all, image nor a repo id"):
        judged(values.LockUpdate, ["latest"])


def test_an_address_in_brackets_is_the_address_and_a_subnet_its_network():
    assert judged(values.HostAddress, "[fd00::0001]") == "fd00::1"
    assert judged(values.HostAddress, "spark-1.lan") == "spark-1.lan"
    assert judged(values.PairSubnet, "192.168.100.7/24") == "192.168.100.0/24"
    with pytest.raises(ValidationError, match="use a /30 or larger"):
        judged(values.PairSubnet, "192.168.100.0/31")


def test_the_stack_names_its_components_and_apt_says_what_a_version_is():
    assert judged(values.StackVersions, {"docker": {"docker.io": None, "containerd": "1:1.7.24~ds1-1"}})
    with pytest.raises(ValidationError, match="unknown component 'firmware'"):
        judged(values.StackVersions, {"firmware": {}})
