"""The mirror on four simulated Sparks: the image and the weights cross the "WAN"
(the testbed's hub and registry) once, every host ends with the same bytes, an interrupted
host resumes, and fleet_mirror=none goes back to direct downloads.

The tests run in file order on a fresh fleet of their own (fixture fleet4), building on
each other's state as a user would.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time
from pathlib import Path

import pytest
import requests
from support.failures import changes

from sparkfleet.ready import READY_PROMPT
from sparkfleet.testbed import login, paths

pytestmark = pytest.mark.e2e

HYBRID = "bleysg/Qwen3.5-122B-A10B-int4-fp8-hybrid"
DFLASH = "z-lab/Qwen3.5-122B-A10B-DFlash"
INTEL = "Intel/Qwen3.5-122B-A10B-int4-AutoRound"
IMAGE_REPO = "sparkfleet/vllm-sim"
HF = "/var/lib/sparkfleet/hf/hub"
MIRROR = "/var/lib/sparkfleet/mirror"  # mirror_dir: olah's cache and the registry's storage
REPO_ROOT = paths.REPO_ROOT
INVENTORY = str(paths.INVENTORY.relative_to(REPO_ROOT))


def hub(tb, method: str, path: str, body: dict | None = None):
    session = requests.Session()
    session.trust_env = False
    response = session.request(method, f"{tb.hub_url}/_testbed/{path}", json=body, timeout=10)
    response.raise_for_status()
    return response.json()


def hold(tb, repo: str, path: str, times: int = 1) -> None:
    """The hub's next GET (``times``: GETs) of ``path`` trickles, a piece a second (no proxy's
    read timeout cuts it), until release(): a transfer held exactly as long as a test needs it."""
    hub(tb, "POST", "fault", {"repo": repo, "path": path, "delay_s": 900, "times": times})


def release(tb, repo: str, path: str) -> None:
    hub(tb, "POST", "fault", {"repo": repo, "path": path, "release": True})


def repo_root(tb, repo: str) -> Path:
    """The hub's directory of the pinned revision of ``repo``."""
    from sparkfleet.testbed.hubservice import REPOS_DIR

    return REPOS_DIR / repo / tb.data["model_revisions"][repo]


def repo_files(tb, repo: str) -> dict[str, str]:
    """The hub's files of the pinned revision: {path: sha256}."""
    root = repo_root(tb, repo)
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def files_bytes(tb, repo: str, path: str) -> bytes:
    return (repo_root(tb, repo) / path).read_bytes()


def file_sizes(tb, repo: str) -> list[int]:
    return [p.stat().st_size for p in repo_root(tb, repo).rglob("*") if p.is_file()]


def repo_size(tb, repo: str) -> int:
    return sum(file_sizes(tb, repo))


def snapshot(tb, name: str, repo: str) -> dict[str, str]:
    """{path: sha256} of the host's cached snapshot of the pinned revision."""
    rev = tb.data["model_revisions"][repo]
    base = f"{HF}/models--{repo.replace('/', '--')}/snapshots/{rev}"
    done = tb.exec(name, f"cd {base} && find -L . -type f -exec sha256sum {{}} +")
    assert done.returncode in (0, 1), (name, done.returncode, done.stderr)  # 1: a file is missing or broken
    return {line.split(None, 1)[1].strip().removeprefix("./"): line.split()[0] for line in done.stdout.splitlines()}


def differ(got: dict[str, str], want: dict[str, str]) -> list[str]:
    """The paths where a snapshot and the hub's files differ, for an assertion's message."""
    return sorted(path for path in set(got) | set(want) if got.get(path) != want.get(path))


def image_on(tb, name: str, reference: str) -> tuple[str, list[str]]:
    out = tb.exec(name, f"docker image inspect --format '{{{{.Id}}}} {{{{json .RepoDigests}}}}' {reference}").stdout
    image_id, digests = out.strip().split(" ", 1)
    return image_id, json.loads(digests)


def blob_stats(tb, name: str, repo: str) -> dict[str, tuple[int, int]]:
    """{blob: (inode, mtime_ns)} of the host's complete blobs of repo."""
    out = tb.exec(name, f"cd {HF}/models--{repo.replace('/', '--')}/blobs 2>/dev/null && "
                        "stat -c '%n %i %Y' $(ls | grep -v incomplete)").stdout
    return {p[0]: (int(p[1]), int(p[2])) for p in (line.split() for line in out.splitlines()) if len(p) == 3}


def mirror_gets(tb, since: float, client: str, repo: str) -> list[str]:
    """Files of ``repo`` that ``client`` GET from the HF mirror (olah's access log on the
    mirror host) since ``since``. By repository: two repositories share file names
    (config.json, model.safetensors.index.json)."""
    out = tb.exec(tb.names[0], f"journalctl -u sparkfleet-hf-mirror --since @{int(since)} -o cat --no-pager").stdout
    return re.findall(rf'{re.escape(client)}:\d+ - "GET /{re.escape(repo)}/resolve/[0-9a-f]+/([^ ]+) HTTP', out)


def shown(tb, name: str) -> str:
    """How pyinfra's output names the host (its inventory name)."""
    return login.inventory_name(name, tb.state.names)


def local_name(tb) -> str:
    """The name hosts run the image by (sparkfleet.mirror.names.local_image)."""
    return f"localhost/sparkfleet/serve:{tb.image['digest'].replace(':', '-')}"


def completion(tb, name: str) -> str:
    body = json.dumps({"model": "qwen", "prompt": READY_PROMPT,
                       "max_tokens": 8, "temperature": 0})
    out = tb.exec(name, "curl -s -m 10 -H @/etc/sparkfleet/api-auth.header -H 'Content-Type: application/json' "
                        f"-d '{body}' http://127.0.0.1:8000/v1/completions").stdout
    try:
        return json.loads(out)["choices"][0]["text"]
    except (ValueError, KeyError, IndexError):
        return ""


def test_a_dgx_os_login_without_its_sudo_password_fails_before_anything(fleet4, tmp_path):
    """The fleet's login is DGX OS's (password sudo): without the password the run stops
    before any fact, saying how to give one, instead of pyinfra prompting mid-run."""
    tb = fleet4
    assert tb.exec(tb.names[0], "id -un", as_root=False).stdout.strip() != "root"
    inventory = tmp_path / "no_password.py"
    inventory.write_text(
        "from pathlib import Path\nfrom sparkfleet.testbed.state import inventory_hosts\n"
        f"_all = inventory_hosts(Path({str(paths.HOSTS_JSON)!r}))\n"
        "sparks = ([(n, {k: v for k, v in d.items() if k != '_sudo_password'}) for n, d in _all], {})\n"
    )
    done = subprocess.run(["pyinfra", "-y", str(inventory), "deploy.py"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    assert "sudo needs a password and none was given" in out and "--same-sudo-password" in out, out[-2000:]
    assert "_sudo_password" in out and "sudo password:" not in out, out[-2000:]
    assert "Starting operation" not in out, out[-2000:]


def test_the_fleet_takes_each_artifact_from_upstream_once(fleet4, deploy_run):
    tb = fleet4
    mirror = tb.hosts[0]
    hub(tb, "POST", "reset")
    mark = tb.registry_mark()
    result = deploy_run("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]

    # The hub: each file of the profile's repositories once, all of it to the mirror. At
    # most one file of a repository twice: olah publishes a file to its cache only when the
    # transfer that fetched it ends, and on a loaded machine a host's request may end
    # first (seen with two fleets on two cores: 1 file of 21); the next request fetches it again.
    stats = hub(tb, "GET", "stats")
    for repo in (HYBRID, DFLASH):
        assert repo_size(tb, repo) * 0.99 <= stats["by_repo"][repo] <= repo_size(tb, repo) * 1.01 + \
            max(file_sizes(tb, repo)), stats
    assert set(stats["by_client"]) == {mirror.address}
    # The mirror fetched them while the image crossed, and the deploy read what it started:
    # no task is left loaded on any host.
    assert re.search(r"mirror-holds-\S+: started as ", out), out[-3000:]
    for name in tb.names:
        assert tb.exec(name, "systemctl list-units --all --no-legend 'sparkfleet-task-*'").stdout.strip() == "", name
    # No byte past the mirror: the hub offers Xet like the Hub, and a client on the Xet path
    # would go straight to its CAS (the downloads run with HF_HUB_DISABLE_XET=1).
    assert stats["cas_requests"] == 0 and stats["xet_token_requests"] == 0, stats

    # The registry: the image's blobs once, to the mirror.
    served = tb.registry_stats(mark)
    assert served["by_repo"][IMAGE_REPO] == pytest.approx(tb.image["blob_bytes"], rel=0.01), served
    assert set(served["by_client"]) == {mirror.address}

    # Every host: the same image (digest and id), the same files as the hub's, READY.
    local_ref = f"{mirror.address}:5000/{IMAGE_REPO}:0.23.0@{tb.image['digest']}"
    images = {name: image_on(tb, name, local_ref) for name in tb.names}
    assert len({image_id for image_id, _ in images.values()}) == 1
    for name, (_, digests) in images.items():
        assert digests == [f"{mirror.address}:5000/{IMAGE_REPO}@{tb.image['digest']}"], (name, digests)
    for repo in (HYBRID, DFLASH):
        expected = repo_files(tb, repo)
        for name in tb.names:
            got = snapshot(tb, name, repo)
            assert got == expected, (name, repo, differ(got, expected))
    for name in tb.names:
        unit = tb.exec(name, "cat /etc/systemd/system/sparkfleet-serve.service").stdout
        # Run by the local name, the pulled image under it: the mirror's address is not in the unit.
        assert "--pull never" in unit and local_name(tb) in unit and mirror.address not in unit
        assert image_on(tb, name, local_name(tb))[0] == images[name][0]
        assert "Paris" in completion(tb, name)

    # The report: per host and for the fleet, measured.
    assert "--> Downloads (mirror: spark-1" in out, out[-3000:]
    for name in tb.names:
        assert re.search(rf"\[{re.escape(shown(tb, name))}\] image [\d.]+ MiB from the mirror, "
                         r"weights [\d.]+ MiB from the mirror", out), out[-3000:]
    image_mib = tb.image["blob_bytes"] / 2**20
    assert f"from upstream: image {image_mib:.1f} MiB (copied once into the mirror registry)" in out
    # Upstream weights as the mirror saw them (olah's cache), 1.00x the artifacts.
    upstream = re.search(r"weights ([\d.]+) MiB \(into the HF mirror's cache\)", out)
    artifacts_mib = (repo_size(tb, HYBRID) + repo_size(tb, DFLASH)) / 2**20
    assert upstream and float(upstream.group(1)) == pytest.approx(artifacts_mib, rel=0.05, abs=0.1), out[-3000:]
    assert "NOT through the mirror" not in out and "past the mirror" not in out
    assert re.search(r"download steps took [\d.]+ s", out)


def test_a_converged_fleet_changes_nothing(fleet4, deploy_run):
    result = deploy_run("deploy.py")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-3000:]
    assert changes(out) == [], out[-3000:]
    assert "--> Downloads" not in out


def test_a_host_interrupted_mid_download_resumes_without_refetching_complete_files(fleet4, deploy_run):
    tb = fleet4
    victim = tb.hosts[3]
    slow = "model-00009-of-00014.safetensors"
    hub(tb, "POST", "reset")
    # The hub holds one file of the Intel checkpoint (a piece a second, so olah's 15 s read
    # timeout does not cut it) until the victim is cut off: the mirror's prefetch asks for
    # it as the run starts, and under CI's load the victim's planning and preflight took
    # past a minute to reach the weights.
    hold(tb, INTEL, slow)
    files = repo_files(tb, INTEL)
    cmd = ["pyinfra", "-y", INVENTORY, "deploy.py", "--data", "profile=base"]
    with subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as run:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if len(blob_stats(tb, victim.name, INTEL)) >= len(set(files.values())) - 1:
                break
            time.sleep(0.5)
        else:
            run.kill()
            pytest.fail("the victim never got the fast files")
        killed = tb.exec(victim.name, "docker kill sparkfleet-fetch-intel--qwen3.5-122b-a10b-int4-autoround")
        release(tb, INTEL, slow)
        assert killed.returncode == 0, killed.stderr
        first, _ = run.communicate(timeout=600)
    assert run.returncode != 0
    assert f"[{shown(tb, victim.name)}] Error" in first
    for name in tb.names[:3]:
        assert f"[{shown(tb, name)}] Error" not in first and "Paris" in completion(tb, name)

    complete = blob_stats(tb, victim.name, INTEL)
    assert 0 < len(complete) < len(files)
    since = time.time()
    time.sleep(1)
    second = deploy_run("deploy.py", "--data", "profile=base")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    assert "Paris" in completion(tb, victim.name)
    assert snapshot(tb, victim.name, INTEL) == files
    # Complete files were kept as they were, and only the missing ones were asked for.
    after = blob_stats(tb, victim.name, INTEL)
    assert {blob: after[blob] for blob in complete} == complete
    refetched = mirror_gets(tb, since, victim.address, INTEL)
    assert slow in refetched and len(refetched) == len(set(refetched)), refetched
    assert len(refetched) <= len(files) - len(complete), refetched
    # Upstream, over both runs: every complete file once. The file in flight may come twice:
    # olah 0.5.4 cancels a shared upstream download when the client that started it goes
    # away (here, if the victim asked first), and the next waiting client starts it again.
    stats = hub(tb, "GET", "stats")
    in_flight = repo_size(tb, INTEL) + len(files_bytes(tb, INTEL, slow))
    assert repo_size(tb, INTEL) * 0.99 <= stats["by_repo"][INTEL] <= in_flight * 1.01, stats
    assert set(stats["by_client"]) == {tb.hosts[0].address}


def test_a_killed_controller_then_a_re_run_fetches_no_file_twice(fleet4, deploy_run):
    """The controller dies mid-download (SIGKILL, as a closed laptop lid or a cut link to
    it): the downloads it started run on, detached, and the next run waits for them;
    nothing is fetched twice, from upstream or from the mirror."""
    tb = fleet4
    slug = DFLASH.replace("/", "--")
    for name in tb.names:  # a repository the fleet must fetch again, from upstream too
        tb.exec(name, f"rm -rf {HF}/models--{slug} /var/lib/sparkfleet/hf/sparkfleet/complete/{slug}@*")
    tb.exec(tb.names[0], f"rm -rf /var/lib/sparkfleet/mirror/hf/repos/files/models/{DFLASH} "
                         f"/var/lib/sparkfleet/mirror/hf/repos/api/models/{DFLASH}")
    files = repo_files(tb, DFLASH)
    slow = "model-00003-of-00003.safetensors"
    hub(tb, "POST", "reset")
    hub(tb, "POST", "fault", {"repo": DFLASH, "path": slow, "delay_s": 12, "times": 1})
    since = time.time()
    time.sleep(1)
    with subprocess.Popen(["pyinfra", "-y", INVENTORY, "deploy.py"], cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL) as run:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and hub(tb, "GET", "stats")["by_repo"].get(DFLASH, 0) == 0:
            time.sleep(0.5)
        time.sleep(2)  # the slow file is on its way (12 s)
        run.kill()
    assert hub(tb, "GET", "stats")["by_repo"].get(DFLASH, 0) < repo_size(tb, DFLASH), "killed too late"
    second = deploy_run("deploy.py")
    out = second.stdout + second.stderr
    assert second.returncode == 0, out[-4000:]
    for name in tb.names:
        assert snapshot(tb, name, DFLASH) == files, name
    # Upstream: each file once (1.00x), to the mirror only, none through the Xet CAS.
    stats = hub(tb, "GET", "stats")
    assert stats["by_repo"][DFLASH] == pytest.approx(repo_size(tb, DFLASH), rel=0.01), stats
    assert set(stats["by_client"]) == {tb.hosts[0].address} and stats["cas_requests"] == 0, stats
    # The mirror: each host asked for each file once over both runs.
    for h in tb.hosts:
        got = mirror_gets(tb, since, h.address, DFLASH)
        weights = [f for f in got if f in files]
        assert sorted(weights) == sorted(set(weights)), (h.name, got)
        assert set(weights) <= set(files) and slow in weights, (h.name, got)


def test_turning_the_mirror_off_goes_direct(fleet4, deploy_run):
    tb = fleet4
    # A repository the hosts no longer have, to see where it comes from.
    for name in tb.names:
        tb.exec(name, f"rm -rf {HF}/models--{DFLASH.replace('/', '--')} "
                      f"/var/lib/sparkfleet/hf/sparkfleet/complete/{DFLASH.replace('/', '--')}@*")
    hub(tb, "POST", "reset")
    mark = tb.registry_mark()
    result = deploy_run("deploy.py", "--data", "fleet_mirror=none")
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    stats = hub(tb, "GET", "stats")
    size = repo_size(tb, DFLASH)
    assert stats["by_repo_client"][DFLASH] == {h.address: size for h in tb.hosts}, stats
    for name in tb.names:
        unit = tb.exec(name, "cat /etc/systemd/system/sparkfleet-serve.service").stdout
        assert local_name(tb) in unit  # the same image by the same name: no restart for it
        assert "Paris" in completion(tb, name)
    # The image was already there: no blob came from the registry again. The former
    # mirror's services are stopped.
    assert tb.registry_stats(mark)["by_repo"].get(IMAGE_REPO, 0) < 0.01 * tb.image["blob_bytes"]
    state = tb.exec(tb.names[0], "systemctl is-active sparkfleet-hf-mirror docker-registry").stdout.split()
    assert state == ["inactive", "inactive"], state
    assert re.search(r"\[spark-\d(?:\.local)?\] weights [\d.]+ MiB from upstream", out), out[-3000:]
    assert "image pulled from upstream" not in out  # the hosts have it under its local name


def registry_clients(tb, name: str, since: float) -> set[str]:
    """The addresses that pulled from ``name``'s registry since ``since``: its manifest (a
    host that still holds the layers, under a running engine, asks for no blob; one whose
    content store still holds the manifest only resolves the digest, a HEAD)."""
    out = tb.exec(name, f"journalctl -u docker-registry --since @{int(since)} -o cat --no-pager").stdout
    return set(re.findall(r'^(\S+) - \S+ \[[^\]]*\] "(?:GET|HEAD) /v2/\S+/(?:blobs|manifests)/', out, re.M))


def test_past_the_fanout_hosts_fetch_from_relays_and_a_dead_relay_costs_a_retry(fleet4, deploy_run):
    """fleet_fanout=1: a chain, spark-1 -> spark-2 -> spark-3 -> spark-4 (the two in the
    middle relays). The relay of spark-4 dies while the weights are on their way: spark-4
    fetches from the fleet's mirror instead (spark-3 from the relay above it), and the
    deploy succeeds; the WAN still sends every file once, to the fleet's mirror only."""
    tb = fleet4
    first, second, third, last = tb.hosts
    slug = DFLASH.replace("/", "--")
    for name in tb.names:  # the repository (and, below the mirror, the image) fetched again
        tb.exec(name, f"rm -rf {HF}/models--{slug} /var/lib/sparkfleet/hf/sparkfleet/complete/{slug}@*")
    # Every name of the image untagged (the running engine keeps its layers). By name: an
    # image ID a running container uses cannot be deleted, even forced. None: a run before
    # (this test's first try) did not get it back.
    names = "{{range .RepoTags}}{{.}} {{end}}{{range .RepoDigests}}{{.}} {{end}}"
    tb.exec(last.name, f"names=$(docker image inspect -f '{names}' {local_name(tb)} 2>/dev/null); "
                       '[ -z "$names" ] || docker rmi -f $names', check=True)
    # What the mirror's olah holds of it, and what a run before made the relays hold (this
    # test's first try): their olah's copy and their registry's image, so the chain carries
    # both again and each registry's log shows who pulled from it.
    for host in (first, second, third):
        tb.exec(host.name, f"rm -rf {MIRROR}/hf/repos/files/models/{DFLASH} {MIRROR}/hf/repos/api/models/{DFLASH}")
    for host in (second, third):
        tb.exec(host.name, f"if systemctl -q is-active docker-registry; then systemctl stop docker-registry; "
                           f"rm -rf {MIRROR}/registry/*; systemctl start docker-registry; fi")
    files = repo_files(tb, DFLASH)
    slow = "model-00003-of-00003.safetensors"
    hub(tb, "POST", "reset")
    # Until the relay is dead: spark-4 cannot have the whole repository before. Every GET of
    # it: two olah requests racing for one block (a loaded machine widens the race) each ask
    # the hub, and an unheld second one let the chain finish before the relay died.
    hold(tb, DFLASH, slow, times=100)
    since = time.time()
    time.sleep(1)
    cmd = ["pyinfra", "-y", INVENTORY, "deploy.py", "--data", "fleet_fanout=1"]
    with subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          stdin=subprocess.DEVNULL) as run:
        deadline = time.monotonic() + 300
        fetcher = f"sparkfleet-fetch-{slug.lower()}"
        while time.monotonic() < deadline:
            if fetcher in tb.exec(last.name, "docker ps --format '{{.Names}}'").stdout:
                break
            time.sleep(0.5)
        else:
            run.kill()
            pytest.fail(f"{last.name} never started its download: " + (run.stdout.read() or "")[-3000:])
        time.sleep(5)  # the fast files are in, the slow one is on its way
        # Dies, as a power cut: no graceful end for the downloads in flight, and no restart.
        stopped = tb.exec(third.name, "systemctl kill -s KILL sparkfleet-hf-mirror; systemctl stop sparkfleet-hf-mirror")
        release(tb, DFLASH, slow)
        assert stopped.returncode == 0, stopped.stderr
        out, _ = run.communicate(timeout=900)
    assert run.returncode == 0, around_error(out)
    assert re.search(rf"\[{re.escape(shown(tb, last.name))}\] fetch-\S+: {re.escape(DFLASH)} from "
                     rf"http://{re.escape(third.address)}:8090 failed \(\w+\): fetching from "
                     rf"http://{re.escape(first.address)}:8090", out), \
        "\n".join(line for line in out.splitlines() if "report" in line or "fetch" in line.lower())[-5000:]
    for name in tb.names:
        got = snapshot(tb, name, DFLASH)
        assert got == files, (name, differ(got, files))
        assert "Paris" in completion(tb, name)
    # Upstream: each file once, to the fleet's mirror only.
    stats = hub(tb, "GET", "stats")
    assert stats["by_repo"][DFLASH] <= repo_size(tb, DFLASH) * 1.01 + len(files_bytes(tb, DFLASH, slow)), stats
    assert set(stats["by_client"]) == {first.address}, stats
    # The image came down the chain: each registry served the host below it.
    assert second.address in registry_clients(tb, first.name, since)
    assert third.address in registry_clients(tb, second.name, since)
    assert last.address in registry_clients(tb, third.name, since)
    assert last.address not in registry_clients(tb, first.name, since) | registry_clients(tb, second.name, since)


def around_error(out: str) -> str:
    at = max(out.find("] Error"), out.find("Traceback"))
    return out[max(0, at - 3000):at + 1500] if at >= 0 else out[-4000:]
