"""Testbed state file, hosts.json and switch parsing (no root needed)."""

from __future__ import annotations

import json

import pytest

from sparkfleet.testbed import login, paths, switches
from sparkfleet.testbed.state import HostState, ServiceState, State, inventory_hosts, write_hosts_json

#: The default instance's inventory (an instance N generates its own beside its hosts.json).
TESTBED_INVENTORY = paths.REPO_ROOT / "inventory" / "testbed.py"


def _state() -> State:
    st = State()
    st.hosts["spark-1"] = HostState(name="spark-1", index=1, address="10.213.0.11", netns="sf-spark-1",
                                    veth="sfv-spark-1", pid=4242, switches={"disk_full": True})
    st.hosts["spark-2"] = HostState(name="spark-2", index=2, address="10.213.0.12", netns="sf-spark-2",
                                    veth="sfv-spark-2", pid=None, switches={"gpu": "NVIDIA H100 80GB HBM3"})
    st.services["registry"] = ServiceState(name="registry", pid=99, url="http://10.213.0.1:5000",
                                           marker="/x/config.yml", log="/x/registry.log")
    st.image = {"digest": "sha256:" + "a" * 64, "pinned": "r/x:1@sha256:" + "a" * 64, "size_bytes": 10}
    st.data = {"image": "r/x:1@sha256:" + "a" * 64, "ready_timeout_s": 300}
    return st


def test_round_trip(tmp_path):
    st = _state()
    f = tmp_path / "state.json"
    st.save(f)
    loaded = State.load(f)
    assert loaded is not None
    assert loaded.to_dict() == st.to_dict()
    assert loaded.hosts["spark-1"].pid == 4242
    assert loaded.hosts["spark-2"].switches == {"gpu": "NVIDIA H100 80GB HBM3"}
    assert loaded.services["registry"].marker == "/x/config.yml"
    # atomic write: no temp file left next to it
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_missing_or_corrupt_state_is_none(tmp_path):
    assert State.load(tmp_path / "nope.json") is None
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert State.load(bad) is None
    old = tmp_path / "old.json"
    old.write_text(json.dumps({**_state().to_dict(), "version": 0}))
    assert State.load(old) is None


def test_host_paths_follow_the_contract():
    h = _state().hosts["spark-1"]
    assert h.mnt == paths.HOSTS_DIR / "spark-1" / "root"
    # Instance N (SPARKFLEET_TESTBED_INSTANCE) has its own subnet and names.
    subnet, tag = f"10.{213 + paths.INSTANCE}.0", paths.INSTANCE or ""
    assert paths.host_address(1) == f"{subnet}.11"
    assert paths.host_address(3) == f"{subnet}.13"
    assert paths.netns_name("spark-2") == f"sf{tag}-spark-2"
    assert len(paths.veth_name("spark-50")) <= 15  # IFNAMSIZ - 1
    with pytest.raises(ValueError):
        paths.host_index("web-1")


def test_hosts_json_shape(tmp_path):
    out = tmp_path / "hosts.json"
    write_hosts_json(_state(), ssh_key=tmp_path / "id_ed25519", path=out)
    doc = json.loads(out.read_text())
    assert set(doc) == {"hosts", "data", "login", "names", "pairs"}
    assert doc["pairs"] == []  # no simulated ConnectX-7 links unless `up --pairs N`
    assert (doc["login"], doc["names"]) == ("root", "plain")
    assert [h["name"] for h in doc["hosts"]] == ["spark-1", "spark-2"]
    assert doc["hosts"][0] == {"name": "spark-1", "inventory_name": "spark-1", "address": "10.213.0.11",
                               "user": "root", "ssh_key": str(tmp_path / "id_ed25519"),
                               "switches": {"disk_full": True}}
    assert doc["data"]["ready_timeout_s"] == 300


def test_inventory_reads_hosts_json(tmp_path, monkeypatch):
    """inventory/testbed.py turns hosts.json into pyinfra host tuples with the data."""
    src = TESTBED_INVENTORY.read_text()
    hosts_json = tmp_path / ".testbed" / paths.HOSTS_JSON.relative_to(paths.DOT_TESTBED)  # this instance's
    write_hosts_json(_state(), ssh_key=tmp_path / "k", path=hosts_json)
    inv = tmp_path / "inventory" / "testbed.py"
    inv.parent.mkdir()
    inv.write_text(src)
    ns: dict = {"__file__": str(inv)}
    exec(compile(src, str(inv), "exec"), ns)
    hosts, group = ns["sparks"]
    assert group == {}
    name, data = hosts[0]
    assert name == "spark-1"
    assert data["ssh_hostname"] == "10.213.0.11"
    assert data["ssh_user"] == "root"
    assert data["ssh_key"] == str(tmp_path / "k")
    assert data["ssh_strict_host_key_checking"] == "no"
    assert data["ssh_known_hosts_file"] == "/dev/null"
    assert data["ready_timeout_s"] == 300


def test_inventory_of_a_dgx_login_with_alias_names(tmp_path):
    """dgx login: the user, _sudo and the password from its 0600 file (not from hosts.json);
    alias names: no address in the inventory, only the ssh_config knows it."""
    st = _state()
    st.login, st.names = "dgx", "alias"
    for h in st.hosts.values():
        h.user = login.LOGIN_USER
    hosts_json = tmp_path / "hosts.json"
    password = login.new_password(tmp_path / "sudo-password")
    assert (tmp_path / "sudo-password").stat().st_mode & 0o777 == 0o600
    write_hosts_json(st, ssh_key=tmp_path / "k", path=hosts_json)
    assert password not in hosts_json.read_text()
    (name, data), _ = inventory_hosts(hosts_json)
    assert name == "spark-1.local" and "ssh_hostname" not in data
    assert (data["ssh_user"], data["_sudo"], data["_sudo_password"]) == (login.LOGIN_USER, True, password)
    assert data["ssh_config_file"] == str(tmp_path / "ssh_config")
    import paramiko

    cfg = paramiko.SSHConfig.from_path(data["ssh_config_file"])
    found = cfg.lookup("spark-2.local")
    assert (found["hostname"], found["user"]) == ("10.213.0.12", login.LOGIN_USER)
    assert cfg.lookup("spark-2")["hostname"] == "spark-2"  # nothing else is aliased


def test_the_hosts_keys_are_checked_as_a_real_fleets_known_hosts_checks_them(tmp_path):
    """Keys made at provisioning go to a known_hosts file of this fleet's alone (pyinfra keeps
    a file it read for its process's life); pyinfra and the ssh_config refuse another key."""
    st = _state()
    st.names = "alias"
    for h in st.hosts.values():
        h.host_keys = [f"ssh-ed25519 AAAA{h.name}", f"ecdsa-sha2-nistp256 BBBB{h.name}"]
    hosts_json = tmp_path / "hosts.json"
    write_hosts_json(st, ssh_key=tmp_path / "k", path=hosts_json)
    known = tmp_path / f"{paths.KNOWN_HOSTS.name}.{st.run_id}"
    assert json.loads(hosts_json.read_text())["known_hosts"] == str(known)
    assert known.read_text().splitlines() == [
        "spark-1.local,10.213.0.11 ssh-ed25519 AAAAspark-1", "spark-1.local,10.213.0.11 ecdsa-sha2-nistp256 BBBBspark-1",
        "spark-2.local,10.213.0.12 ssh-ed25519 AAAAspark-2", "spark-2.local,10.213.0.12 ecdsa-sha2-nistp256 BBBBspark-2"]
    (_, data), _ = inventory_hosts(hosts_json)
    assert (data["ssh_strict_host_key_checking"], data["ssh_known_hosts_file"]) == ("yes", str(known))
    import paramiko

    found = paramiko.SSHConfig.from_path(data["ssh_config_file"]).lookup("spark-2.local")
    assert (found["stricthostkeychecking"], found["userknownhostsfile"]) == ("yes", str(known))


def test_host_keys_are_listed_ed25519_first_as_openssh_prefers():
    from sparkfleet.testbed.hosts import by_preference

    made = ["ssh-rsa AAAAr", "ecdsa-sha2-nistp256 AAAAe", "ssh-ed25519 AAAAd", "ssh-dss AAAAx"]
    assert by_preference(made) == ["ssh-ed25519 AAAAd", "ecdsa-sha2-nistp256 AAAAe", "ssh-rsa AAAAr",
                                   "ssh-dss AAAAx"]


def test_root_command_through_sudo_reads_the_password_from_stdin(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "SUDO_PASSWORD_FILE", tmp_path / "pw")
    monkeypatch.setattr(login, "password", lambda path=None: "s3cret")
    assert login.as_root("id -u", "root") == ("id -u", None)
    command, stdin = login.as_root("docker ps 'x'", login.LOGIN_USER)
    assert command == "sudo -k -S -p '' -- sh -c 'docker ps '\"'\"'x'\"'\"''" and stdin == "s3cret\n"
    assert "s3cret" not in command
    with pytest.raises(Exception, match="--login"):
        login.check("admin", "plain")


def test_inventory_without_hosts_json_says_what_to_do(tmp_path):
    inv = tmp_path / "inventory" / "testbed.py"
    inv.parent.mkdir()
    src = TESTBED_INVENTORY.read_text()
    with pytest.raises(SystemExit, match="sparkfleet testbed up"):
        exec(compile(src, str(inv), "exec"), {"__file__": str(inv)})


def test_switch_specs():
    names = ["spark-1", "spark-2", "spark-3"]
    got = switches.parse_specs(
        ["spark-2:gpu=NVIDIA H100 80GB HBM3", "spark-2:compute_cap=9.0", "spark-1:disk_full",
         "spark-3:arch=x86_64", "spark-3:no_nvidia_runtime=1", "spark-1:no_nvidia_runtime=0"],
        names,
    )
    assert got == {
        "spark-2": {"gpu": "NVIDIA H100 80GB HBM3", "compute_cap": "9.0"},
        "spark-1": {"disk_full": True},
        "spark-3": {"arch": "x86_64", "no_nvidia_runtime": True},
    }


@pytest.mark.parametrize("spec", ["spark-9:disk_full", "spark-1", "spark-1:warp_drive", "spark-1:arch=sparc",
                                  "spark-1:disk_full=maybe", "spark-1:compute_cap=9.0"])
def test_bad_switch_specs(spec):
    with pytest.raises(ValueError):
        switches.parse_specs([spec], ["spark-1", "spark-2"])


def test_the_reset_command_hard_resets_the_host_with_its_kernel_lines(monkeypatch):
    from sparkfleet.testbed import cli, fleet

    asked = []

    class Bed:
        def hard_reset(self, name, kernel_errors=()):
            asked.append((name, list(kernel_errors)))

    monkeypatch.setattr(fleet, "load", Bed)
    xid = "NVRM: Xid (PCI:000f:01:00): 79, GPU has fallen off the bus."
    assert cli.main(["reset", "spark-2", "--kernel-error", xid]) == 0
    assert cli.main(["reset", "spark-3"]) == 0
    assert asked == [("spark-2", [xid]), ("spark-3", [])]
