#!/usr/bin/env python3
"""The fleet source's image copy on the simulated fleet: is skopeo byte-exact, and does it
read each blob from upstream once?

    python3 benchmarks/bench_image_copy.py [--rate 40mbit] [--cut 3]     # as root

On spark-1 of the simulated fleet that is up (else one of 1 host is booted and left up),
with ``docker-registry`` and ``skopeo`` installed from the testbed's apt repository as the
deploy installs them on a mirror host, each scenario runs the mirror's copy command
(sparkfleet.mirror.registry.copy_command: ``skopeo copy --all --preserve-digests``) of the
testbed registry's serving image (pinned by digest) into an empty registry on that host,
over TLS with a mirror certificate:

* cold: the copy into the empty registry;
* again: the same copy once more, everything already there;
* cut: the copy killed after ``--cut`` s while upstream is limited to ``--rate``, then run
  again to the end (what a re-run after a dropped connection does);
* index: a multi-platform index (a Docker manifest list made in the testbed registry from
  the image's manifest), copied whole.

For each: whether the copy's manifest digest is the source's (the registry's
Docker-Content-Digest and the sha256 of the manifest bytes it serves), the GETs of each
blob from upstream (the testbed registry's access log, this host's requests only), the
blob bytes read from upstream over the image's blob bytes, and the wall time. Exits 1
when a property fails: digest kept in every scenario, every blob read exactly once in
cold and index, none in again, and in cut only the blobs cut off half-way read again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HOST = "spark-1"
DEST = "127.0.0.1:5099"  # the empty registry of a scenario, on the host
DEST_DIR = "/var/tmp/bench-image-copy"
CERT_DIR = "/var/tmp/bench-image-copy-certs"  # its certificate, as docker's certs.d holds it
MANIFEST_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
ACCEPT = ("application/vnd.docker.distribution.manifest.v2+json,application/vnd.oci.image.manifest.v1+json,"
          f"{MANIFEST_LIST},application/vnd.oci.image.index.v1+json")
BLOB_GET = re.compile(r'^(\S+) - \S+ \[[^\]]*\] "GET /v2/\S+/blobs/(sha256:[0-9a-f]+) [^"]*" (\d+) (\d+)')
REGISTRY_CONFIG = f"""version: 0.1
log:
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {DEST_DIR}/storage
http:
  addr: {DEST}
  tls:
    certificate: {CERT_DIR}/ca.crt
    key: {CERT_DIR}/key.pem
"""


def sh(tb, command: str, timeout: float = 600, check: bool = True) -> str:
    done = tb.exec(HOST, command, timeout=timeout)
    if check and done.returncode != 0:
        raise SystemExit(f"{HOST}: {command!r} failed ({done.returncode}): {done.stdout[-800:]}{done.stderr[-800:]}")
    return done.stdout


def install(tb) -> str:
    """docker-registry and skopeo on the host, from the testbed's signed apt repository."""
    if sh(tb, "command -v docker-registry skopeo | wc -l").strip() != "2":
        keyring, sources = "/usr/share/keyrings/bench-image-copy.asc", "/etc/apt/sources.list.d/bench-image-copy.list"
        sh(tb, f"curl -fsSL {tb.apt_url}gpgkey -o {keyring} && "
               f"echo 'deb [signed-by={keyring}] {tb.apt_url} /' > {sources} && "
               f"apt-get update -o Dir::Etc::sourcelist={sources} -o Dir::Etc::sourceparts=- -qq && "
               "DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-registry skopeo")
    return sh(tb, "skopeo --version").strip()


def certificate(tb) -> None:
    """A mirror certificate for DEST, made as the deploy makes one, on the host."""
    import tempfile

    from sparkfleet import credentials
    from sparkfleet.mirrors import Mirror

    with tempfile.TemporaryDirectory() as tls_dir:
        cert, key = credentials.mirror_tls(tls_dir, Mirror(HOST, DEST.split(":")[0], 1, int(DEST.split(":")[1]), True))
        sh(tb, f"mkdir -p {CERT_DIR} && printf %s {shlex.quote(cert.read_text())} > {CERT_DIR}/ca.crt && "
               f"(umask 077; printf %s {shlex.quote(key.read_text())} > {CERT_DIR}/key.pem)")


def fresh_registry(tb) -> None:
    """An empty registry at DEST on the host (a transient unit, replaced per scenario)."""
    sh(tb, f"systemctl stop bench-image-copy-registry 2>/dev/null; rm -rf {DEST_DIR} && mkdir -p {DEST_DIR} && "
           f"printf %s {shlex.quote(REGISTRY_CONFIG)} > {DEST_DIR}/config.yml && "
           f"systemd-run --quiet --unit=bench-image-copy-registry --collect docker-registry serve {DEST_DIR}/config.yml && "
           f"for i in $(seq 50); do curl -fs --cacert {CERT_DIR}/ca.crt https://{DEST}/v2/ >/dev/null && exit 0; "
           "sleep 0.1; done; exit 1")


def upstream_manifest(tb, repo: str, reference: str) -> tuple[bytes, str]:
    from sparkfleet.testbed import paths

    request = urllib.request.Request(f"http://{paths.REGISTRY}/v2/{repo}/manifests/{reference}", headers={"Accept": ACCEPT})
    with urllib.request.urlopen(request, timeout=30) as response:
        return response.read(), response.headers["Content-Type"]


def blobs_of(tb, repo: str, body: bytes) -> dict[str, int]:
    doc = json.loads(body)
    if "manifests" in doc:
        found: dict[str, int] = {}
        for child in doc["manifests"]:
            found.update(blobs_of(tb, repo, upstream_manifest(tb, repo, child["digest"])[0]))
        return found
    return {d["digest"]: int(d["size"]) for d in [doc["config"], *doc["layers"]]}


def make_index(tb, repo: str, digest: str) -> str:
    """A manifest list in the upstream registry whose one entry is the image; its digest."""
    body, media_type = upstream_manifest(tb, repo, digest)
    index = json.dumps({"schemaVersion": 2, "mediaType": MANIFEST_LIST, "manifests": [{
        "mediaType": media_type, "digest": digest, "size": len(body),
        "platform": {"architecture": "arm64", "os": "linux"}}]}, indent=3).encode()
    from sparkfleet.testbed import paths

    request = urllib.request.Request(f"http://{paths.REGISTRY}/v2/{repo}/manifests/bench-index", data=index,
                                     method="PUT", headers={"Content-Type": MANIFEST_LIST})
    urllib.request.urlopen(request, timeout=30).close()
    return "sha256:" + hashlib.sha256(index).hexdigest()


def upstream_reads(tb, mark: int, client: str) -> dict[str, list[int]]:
    """Bytes of each blob GET from the upstream registry since ``mark``, by digest."""
    from sparkfleet.testbed import paths

    with open(paths.LOG_DIR / "registry.log", "rb") as log:
        log.seek(mark)
        text = log.read().decode("utf-8", "replace")
    reads: dict[str, list[int]] = {}
    for line in text.splitlines():
        m = BLOB_GET.match(line)
        if m and m.group(1) == client:
            reads.setdefault(m.group(2), []).append(int(m.group(4)))
    return reads


def copy(tb, source: str, digest: str, cut: float | None = None) -> tuple[float, int]:
    """The mirror's copy of SOURCE@DIGEST into the host's empty registry; (s, rc)."""
    from sparkfleet.imagename import ImageName
    from sparkfleet.mirror.registry import copy_command

    registry, _ = source.split("/", 1)
    command = copy_command(f"http://{registry}", ImageName.parse(f"{source}@{digest}"), DEST, CERT_DIR)
    if cut:
        command = f"timeout -s KILL {cut} {command}"
    started = time.monotonic()
    done = tb.exec(HOST, command, timeout=900)
    seconds = time.monotonic() - started
    if not cut and done.returncode != 0:
        raise SystemExit(f"skopeo failed: {done.stdout[-1500:]}{done.stderr[-1500:]}")
    return seconds, done.returncode


def copied_digest(tb, repo: str, digest: str) -> tuple[str, str]:
    """(Docker-Content-Digest header, sha256 of the bytes) of the copy's manifest."""
    out = sh(tb, f"curl -fs --cacert {CERT_DIR}/ca.crt -D /dev/stderr -H 'Accept: {ACCEPT}' https://{DEST}/v2/{repo}/manifests/{digest} "
                 f"2>{DEST_DIR}/headers | sha256sum; grep -i '^docker-content-digest' {DEST_DIR}/headers")
    lines = out.splitlines()
    return lines[1].split(":", 1)[1].strip(), "sha256:" + lines[0].split()[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="40mbit", help="upstream limit (tc syntax) while the cut copy runs")
    ap.add_argument("--cut", type=float, default=5.0, help="seconds after which the cut copy is killed")
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the simulated fleet needs network namespaces and systemd-nspawn")
    from sparkfleet.testbed import fleet

    status = fleet.status()
    tb = fleet.load() if status and any(h["name"] == HOST and h["ssh"] for h in status["hosts"]) else fleet.up(1)
    client = next(h["address"] for h in tb.status()["hosts"] if h["name"] == HOST)
    image = tb.data["image"]  # REGISTRY/REPO:TAG@DIGEST
    source, digest = image.split("@")
    source = source.rsplit(":", 1)[0]
    repo = source.split("/", 1)[1]
    version = install(tb)
    certificate(tb)
    blobs = blobs_of(tb, repo, upstream_manifest(tb, repo, digest)[0])
    image_bytes = sum(blobs.values())
    index_digest = make_index(tb, repo, digest)

    rows, failures = [], []

    def measure(name: str, want_digest: str, runs, expect) -> None:
        from sparkfleet.testbed.registry import access_log_size

        mark = access_log_size()
        seconds = sum(run()[0] for run in runs)
        time.sleep(0.5)  # the registry's access log lines of the last responses
        reads = upstream_reads(tb, mark, client)
        header, body = copied_digest(tb, repo, want_digest)
        read_bytes = sum(sum(v) for v in reads.values())
        counts = {d: len(reads.get(d, [])) for d in blobs}
        rows.append((name, header == body == want_digest, counts, read_bytes / image_bytes, seconds))
        if not header == body == want_digest:
            failures.append(f"{name}: the copy's digest is {header} (bytes: {body}), not {want_digest}")
        problem = expect(counts, reads)
        if problem:
            failures.append(f"{name}: {problem} (GETs per blob: {counts})")

    config = json.loads(upstream_manifest(tb, repo, digest)[0])["config"]["digest"]
    layers = set(blobs) - {config}

    def once(counts, reads):
        return None if set(counts.values()) == {1} else "a blob not read exactly once"

    fresh_registry(tb)
    measure("cold", digest, [lambda: copy(tb, source, digest)], once)
    # skopeo reads the image config from the source on every run (to copy it); layers the
    # destination holds are skipped.
    measure("again", digest, [lambda: copy(tb, source, digest)],
            lambda counts, reads: "a layer read again" if any(counts[d] for d in layers) else None)

    fresh_registry(tb)
    held: set[str] = set()

    def cut_run():
        tb.set_wan_rate(args.rate)
        try:
            result = copy(tb, source, digest, cut=args.cut)
        finally:
            tb.set_wan_rate(None)
        held.update(d for d in layers if sh(tb, f"curl -s -o /dev/null -w '%{{http_code}}' -I "
                                                f"--cacert {CERT_DIR}/ca.crt https://{DEST}/v2/{repo}/blobs/{d}").strip() == "200")
        return result

    def resumed(counts, reads):
        # A layer the cut run copied whole is not read again; one it cut off is read again
        # from its start (once); the config once per run that got to it.
        if any(counts[d] != 1 for d in held):
            return f"layers the destination held after the cut read again: {[d[7:15] for d in held if counts[d] != 1]}"
        if any(not 1 <= counts[d] <= 2 for d in layers - held) or counts[config] > 2:
            return "a blob read more than once per run"
        return None

    measure("cut, then again", digest, [cut_run, lambda: copy(tb, source, digest)], resumed)

    fresh_registry(tb)
    measure("index", index_digest, [lambda: copy(tb, source, index_digest)], once)
    sh(tb, f"systemctl stop bench-image-copy-registry; rm -rf {DEST_DIR} {CERT_DIR}")

    print(f"image copy with {version} on {HOST} of the simulated fleet; image {source}@{digest[:19]}: "
          f"{len(blobs)} blobs, {image_bytes:,} B; cut copy: killed after {args.cut:g} s at {args.rate}\n")
    print(f"{'scenario':<18} {'digest kept':>11} {'upstream B / image':>19} {'seconds':>8}  GETs per blob")
    for name, kept, counts, ratio, seconds in rows:
        print(f"{name:<18} {'yes' if kept else 'NO':>11} {ratio:>18.2f}x {seconds:>8.1f}  "
              + " ".join(f"{d[7:15]}{'(config)' if d == config else ''}:{n}" for d, n in counts.items()))
    print(f"\ncut: the destination held {len(held)} of {len(layers)} layers when the copy was killed")
    for failure in failures:
        print(f"FAILED {failure}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
