"""A fleet as strict as DGX OS: a password-sudo login user, no root SSH, and inventory
names that only the controller resolves (`sparkfleet testbed up --login dgx --names alias`).

Runs on the session's fleet (tests/e2e/conftest.py), which is booted that way.
"""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest

from sparkfleet.testbed import login, paths

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tb(testbed):
    return testbed


def ssh(target: str, command: str, *, user: str | None = None, stdin: str | None = None,
        config: bool = True) -> subprocess.CompletedProcess[str]:
    """The real ssh client with the controller's key (and the generated ssh_config)."""
    argv = ["ssh", *(["-F", str(paths.SSH_CONFIG)] if config else []), "-i", str(paths.SSH_KEY),
            "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR", "-o", "ConnectTimeout=10", *(["-l", user] if user else []), target, command]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def test_the_password_file_is_private_and_hosts_json_records_the_login(tb):
    assert paths.SUDO_PASSWORD_FILE.stat().st_mode & 0o777 == 0o600
    password = login.password()
    doc = tb.hosts_json.read_text()
    assert password not in doc
    assert '"login": "dgx"' in doc and '"names": "alias"' in doc
    assert password not in paths.SSH_CONFIG.read_text()


def test_the_login_user_is_made_like_dgx_os_first_boot(tb):
    cp = ssh("spark-1.local", "id -un; id -Gn; hostname")
    assert cp.returncode == 0, cp.stderr
    name, groups, hostname = cp.stdout.split("\n")[:3]
    assert (name, hostname) == (login.LOGIN_USER, "spark-1")
    assert "sudo" in groups.split() and "docker" not in groups.split()


def test_sudo_asks_for_the_password(tb):
    ok = ssh("spark-1.local", "sudo -k -S -p '' id -u", stdin=login.password() + "\n")
    assert (ok.returncode, ok.stdout.strip()) == (0, "0"), ok.stderr
    wrong = ssh("spark-1.local", "sudo -k -S -p '' id -u", stdin="not-the-password\n")
    assert wrong.returncode != 0
    no_password = ssh("spark-1.local", "sudo -n true")
    assert no_password.returncode == 1 and "password is required" in no_password.stderr


def test_a_wrong_sudo_password_stops_the_run_once_naming_its_file(tb, tmp_path):
    """One try of the password, before any fact: one message naming the host, the file the
    password came from and the fix, instead of sudo's 'Sorry, try again.' per command."""
    wrong = tmp_path / "sudo-password"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    inventory = tmp_path / "wrong_password.py"
    inventory.write_text(
        "from pathlib import Path\nfrom sparkfleet.testbed.state import inventory_hosts\n"
        f"_all = inventory_hosts(Path({str(paths.HOSTS_JSON)!r}))\n"
        f"_wrong = {{'_sudo_password': Path({str(wrong)!r}).read_text().strip(), "
        f"'_sudo_password_file': {str(wrong)!r}}}\n"
        "sparks = ([(n, {**d, **_wrong}) for n, d in _all], {})\n"
    )
    done = subprocess.run(["pyinfra", "-y", str(inventory), "deploy.py"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert out.count("sudo refused the password") == 1, out[-3000:]
    assert f"sudo refused the password for {login.LOGIN_USER} (`_sudo_password`, read from {wrong})" in out
    assert "--same-sudo-password" in out and "Starting operation" not in out, out[-3000:]
    assert "Sorry, try again" not in out and "not-the-password" not in out, out[-3000:]


def test_root_has_no_ssh_login(tb):
    for h in tb.hosts:
        cp = ssh(h.address, "id -u", user="root", config=False)
        assert cp.returncode == 255 and "Permission denied" in cp.stderr, (cp.stdout, cp.stderr)
    assert "PermitRootLogin no" in tb.exec("spark-1", "sshd -T | grep -i '^permitrootlogin'").stdout.replace(
        "permitrootlogin", "PermitRootLogin")
    assert tb.exec("spark-1", "ls -A /root/.ssh 2>/dev/null").stdout.strip() == ""


def test_sshd_keeps_dgx_os_limits_and_an_eleventh_channel_is_refused(tb):
    # pyinfra runs every command of a host over one connection: past MaxSessions 10 a
    # channel is refused, on DGX OS as here. The deploy keeps under it (issue 31).
    import paramiko

    spark = tb.hosts[0]
    shown = tb.exec(spark.name, "sshd -T | grep -E '^(maxsessions|maxstartups) '", via="nsenter").stdout.split("\n")
    assert "maxsessions 10" in shown and "maxstartups 10:30:100" in shown
    client = paramiko.SSHClient()
    client.set_missing_host_key_policy(paramiko.AutoAddPolicy())
    client.connect(spark.address, username=login.user("dgx"), key_filename=str(paths.SSH_KEY), timeout=10,
                   allow_agent=False, look_for_keys=False)
    try:
        transport = client.get_transport()
        channels = [transport.open_session() for _ in range(10)]
        with pytest.raises(paramiko.ChannelException):
            transport.open_session()
        for channel in channels:
            channel.close()
    finally:
        client.close()


def test_docker_needs_sudo(tb):
    denied = ssh("spark-1.local", "docker ps")
    assert denied.returncode != 0 and "permission denied" in denied.stderr.lower(), denied.stderr
    assert tb.exec("spark-1", "docker ps -q", via="ssh").returncode == 0  # as root, through sudo


def test_pyinfra_runs_with_sudo_through_the_generated_inventory(tb):
    inventory = str(paths.INVENTORY.relative_to(REPO_ROOT))
    cp = subprocess.run(["pyinfra", "-y", inventory, "exec", "--", "id -u; id -un; hostname"], cwd=REPO_ROOT,
                        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = cp.stdout + cp.stderr
    assert cp.returncode == 0, out[-3000:]
    for h in tb.hosts:
        alias = login.inventory_name(h.name, "alias")
        assert f"[{alias}] 0" in out and f"[{alias}] root" in out and f"[{alias}] {h.name}" in out, out[-3000:]
    assert login.password() not in out


def test_the_sudo_password_is_in_no_command_line(tb):
    """sshd runs each command as ``<login shell> -c COMMAND``: a login shell that logs its
    arguments sees every command line pyinfra sends the host, sudo's included (pyinfra's
    own way would show ``PYINFRA_SUDO_PASSWORD=<password>`` there, readable in ``ps``)."""
    name, user = "spark-1", login.LOGIN_USER
    shell = "/usr/local/bin/sparkfleet-logged-shell"
    log = "/tmp/sparkfleet-logged-commands"
    before = tb.exec(name, f"getent passwd {user} | cut -d: -f7", via="nsenter").stdout.strip()
    logged = f'#!/bin/sh\nprintf "%s\\n" "$*" >> {log}\nexec {before} "$@"\n'
    tb.exec(name, f"cat > {shell} <<'EOF'\n{logged}EOF\nchmod 755 {shell} && install -m 600 -o {user} /dev/null {log}"
                  f" && usermod -s {shell} {user}", via="nsenter", check=True)
    try:
        inventory = str(paths.INVENTORY.relative_to(REPO_ROOT))
        cp = subprocess.run(["pyinfra", "-y", inventory, "exec", "--limit", login.inventory_name(name, "alias"),
                             "--", "id -u"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
        out = cp.stdout + cp.stderr
        assert cp.returncode == 0 and "] 0" in out, out[-3000:]
        seen = tb.exec(name, f"cat {log}", via="nsenter").stdout
    finally:
        tb.exec(name, f"usermod -s {before} {user}; rm -f {shell} {log}", via="nsenter")
    assert "sudo -H" in seen, seen[-2000:]  # the shell saw pyinfra's commands
    leaked = login.password() in seen or "ASKPASS" in seen  # computed apart: a failure shows no password
    assert not leaked, "the sudo password was in a command line"
    assert "-c sudo -H -S -p '' -k sh -c 'id -u'" in seen, seen[-2000:]


def test_inventory_names_resolve_on_the_controller_only(tb):
    # The controller's resolver does not know them either: only the ssh_config does.
    for h in tb.hosts:
        with pytest.raises(socket.gaierror):
            socket.getaddrinfo(login.inventory_name(h.name, "alias"), 22)
    # A host resolves neither its peer's inventory name nor its peer's own name...
    for name in ("spark-2.local", "spark-2"):
        cp = tb.exec("spark-1", f"getent hosts {name}")
        assert cp.returncode == 2 and cp.stdout == "", (name, cp.stdout)
    # ...and neither does a container on its host network (as the deploy runs them).
    image = tb.data["image"]
    pulled = tb.exec("spark-1", f"docker pull -q {image}", timeout=300)
    assert pulled.returncode == 0, pulled.stderr
    probe = ("import socket\nfor n in ('spark-2.local', 'spark-2', 'spark-1'):\n"
             "    try: print(n, socket.gethostbyname(n))\n    except OSError: print(n, 'unresolved')\n")
    cp = tb.exec("spark-1", f"docker run --rm --network host --entrypoint python3 {image} -c \"{probe}\"",
                 timeout=120)
    assert cp.returncode == 0, cp.stderr
    peer_alias, peer, own = cp.stdout.split("\n")[:3]
    assert (peer_alias, peer) == ("spark-2.local unresolved", "spark-2 unresolved")
    assert own.startswith("spark-1 ") and own != "spark-1 unresolved"  # its own name it knows


def test_the_serving_image_takes_xet_unless_disabled(tb):
    """The sim image's huggingface_hub (with hf_xet, as in a current serving image) goes to
    the hub's Xet CAS, past HF_ENDPOINT; with HF_HUB_DISABLE_XET=1 (as the deploy runs it)
    it does not, and gets the files."""
    import json
    import urllib.request

    def stats() -> dict:
        with urllib.request.urlopen(f"{tb.hub_url}/_testbed/stats", timeout=10) as r:
            return json.load(r)

    image = tb.data["image"]
    assert tb.exec("spark-2", f"docker pull -q {image}", timeout=300).returncode == 0
    repo = "z-lab/Qwen3.5-122B-A10B-DFlash"
    fetch = (f"docker run --rm --network host -e HF_ENDPOINT={tb.hub_url} -e HF_HOME=/tmp/hf {{env}} "
             f"--entrypoint python3 {image} -c \"from huggingface_hub import snapshot_download as s; "
             f"print(s('{repo}', revision='{tb.data['model_revisions'][repo]}'))\"")
    before = stats()["cas_requests"]
    xet = tb.exec("spark-2", fetch.format(env=""), timeout=180)
    assert xet.returncode != 0 and "_testbed/cas" in xet.stderr, xet.stderr[-2000:]
    assert stats()["cas_requests"] > before
    before = stats()["cas_requests"]
    plain = tb.exec("spark-2", fetch.format(env="-e HF_HUB_DISABLE_XET=1"), timeout=180)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert stats()["cas_requests"] == before
