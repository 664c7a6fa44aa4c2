#!/usr/bin/env python3
"""Copy one image from its registry into the fleet's registry, byte for byte (stdlib only).

Uploaded by sparkfleet to the mirror host and run there, as a step of the deploy:

    sparkfleet-copy-image.py SRC_URL REPO REF DST_URL [--tag TAG] [--cacert PEM] [--result JSON]

Manifests and blobs are copied verbatim, so the copy has the digest of the original and
``docker pull DST/REPO@DIGEST`` on every host gets exactly the pinned image. Each blob is
read from the source once: a blob the mirror registry already holds is not fetched again,
so a copy interrupted mid-way continues with the blobs still missing (a blob cut off
half-way is fetched again from its start). An index (multi-platform image) is copied
whole, children included, because the registry accepts an index only with every child.

Credentials for a private source come from /root/.docker/config.json (``auths``), never
from argv. The last line printed is ``RESULT {json}``: digest, bytes read from the source,
bytes that were already there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

MANIFEST_TYPES = (
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.index.v1+json",
)
INDEX_TYPES = MANIFEST_TYPES[2:]
CHUNK = 1 << 20
PROGRESS_EVERY_S = 5.0


class _NoAuthAcrossHosts(urllib.request.HTTPRedirectHandler):
    """Blob downloads redirect to object storage: never send the registry's token there."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and urllib.parse.urlsplit(newurl).netloc != urllib.parse.urlsplit(req.full_url).netloc:
            new.remove_header("Authorization")
        return new


class Registry:
    """Just enough of the registry HTTP API: manifests, blobs, monolithic uploads, token auth."""

    def __init__(self, base: str, cacert: str | None = None):
        self.base = base.rstrip("/")
        context = ssl.create_default_context(cafile=cacert) if cacert else None
        self.opener = urllib.request.build_opener(
            urllib.request.HTTPSHandler(context=context), _NoAuthAcrossHosts()
        )
        self.token: str | None = None
        self.basic = _docker_credentials(urllib.parse.urlsplit(self.base).netloc)

    def request(self, method: str, path: str, headers: dict | None = None, data=None, ok=(200,)):
        url = path if path.startswith(("http://", "https://")) else self.base + path
        for attempt in (1, 2):
            req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
            if self.token:
                req.add_header("Authorization", f"Bearer {self.token}")
            try:
                resp = self.opener.open(req, timeout=300)
            except urllib.error.HTTPError as err:
                if err.code == 401 and attempt == 1 and self._authenticate(err.headers.get("WWW-Authenticate", "")):
                    continue
                if err.code in ok:
                    return err
                raise SystemExit(f"{method} {url}: HTTP {err.code} {err.read()[:300]!r}") from None
            if resp.status not in ok:
                raise SystemExit(f"{method} {url}: HTTP {resp.status}")
            return resp
        raise SystemExit(f"{method} {url}: not authorized")

    def _authenticate(self, challenge: str) -> bool:
        if not challenge.lower().startswith("bearer "):
            return False
        params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
        realm = params.pop("realm", None)
        if not realm:
            return False
        req = urllib.request.Request(realm + "?" + urllib.parse.urlencode(params))
        if self.basic:
            req.add_header("Authorization", f"Basic {self.basic}")
        with self.opener.open(req, timeout=60) as resp:
            doc = json.load(resp)
        self.token = doc.get("token") or doc.get("access_token")
        return bool(self.token)

    def manifest(self, repo: str, ref: str) -> tuple[bytes, str]:
        with self.request("GET", f"/v2/{repo}/manifests/{ref}", {"Accept": ", ".join(MANIFEST_TYPES)}) as resp:
            return resp.read(), resp.headers.get("Content-Type", "").split(";")[0]

    def has(self, repo: str, kind: str, digest: str) -> bool:
        resp = self.request("HEAD", f"/v2/{repo}/{kind}/{digest}", {"Accept": ", ".join(MANIFEST_TYPES)}, ok=(200, 404))
        resp.close()
        return resp.status == 200


def _docker_credentials(netloc: str) -> str | None:
    try:
        auths = json.load(open(os.path.expanduser("~/.docker/config.json"))).get("auths", {})
    except (OSError, ValueError):
        return None
    for key in (netloc, f"https://{netloc}", "https://index.docker.io/v1/" if "docker.io" in netloc else None):
        if key and auths.get(key, {}).get("auth"):
            return auths[key]["auth"]
    return None


class Counter:
    """A readable that counts and hashes what passes, and says how far it got."""

    def __init__(self, stream, size: int, digest: str, totals: dict):
        self.stream, self.size, self.digest, self.totals = stream, size, digest, totals
        self.sha = hashlib.sha256()
        self.done = 0
        self.last = time.monotonic()

    def read(self, n: int = CHUNK) -> bytes:
        data = self.stream.read(min(n, CHUNK))
        self.sha.update(data)
        self.done += len(data)
        self.totals["upstream_bytes"] += len(data)
        if time.monotonic() - self.last >= PROGRESS_EVERY_S:
            self.last = time.monotonic()
            print(f"copying {self.digest[:19]}: {self.done / 2**20:.0f} of {self.size / 2**20:.0f} MiB", flush=True)
        return data


def copy_blob(src: Registry, dst: Registry, repo: str, desc: dict, totals: dict) -> None:
    digest, size = desc["digest"], int(desc["size"])
    if dst.has(repo, "blobs", digest):
        totals["present_bytes"] += size
        return
    with dst.request("POST", f"/v2/{repo}/blobs/uploads/", ok=(202,)) as start:
        location = urllib.parse.urljoin(dst.base + "/", start.headers["Location"])
    with src.request("GET", f"/v2/{repo}/blobs/{digest}") as body:
        reader = Counter(body, size, digest, totals)
        sep = "&" if "?" in location else "?"
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(size)}
        dst.request("PUT", f"{location}{sep}digest={urllib.parse.quote(digest)}", headers, data=reader,
                    ok=(201,)).close()
    if "sha256:" + reader.sha.hexdigest() != digest or reader.done != size:
        raise SystemExit(f"blob {digest}: the source sent {reader.done} bytes that do not match its digest")
    print(f"copied {digest[:19]} ({size / 2**20:.1f} MiB)", flush=True)


def copy_manifest(src: Registry, dst: Registry, repo: str, ref: str, totals: dict, tag: str | None) -> str:
    body, media_type = src.manifest(repo, ref)
    digest = "sha256:" + hashlib.sha256(body).hexdigest()
    if ref.startswith("sha256:") and digest != ref:
        raise SystemExit(f"manifest {ref}: the source sent content with digest {digest}")
    doc = json.loads(body)
    media_type = doc.get("mediaType") or media_type
    if media_type in INDEX_TYPES:
        for child in doc.get("manifests", []):
            copy_manifest(src, dst, repo, child["digest"], totals, None)
    else:
        for desc in [doc["config"], *doc.get("layers", [])]:
            copy_blob(src, dst, repo, desc, totals)
    for target in (digest, tag):
        if target and not (target == digest and dst.has(repo, "manifests", digest)):
            dst.request("PUT", f"/v2/{repo}/manifests/{target}", {"Content-Type": media_type}, data=body,
                        ok=(201,)).close()
    return digest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", help="source registry URL, e.g. https://ghcr.io")
    parser.add_argument("repo", help="repository path, e.g. org/image")
    parser.add_argument("ref", help="digest (sha256:...) or tag to copy")
    parser.add_argument("dst", help="the mirror registry's URL")
    parser.add_argument("--tag", help="also tag the copy (the source's tag)")
    parser.add_argument("--cacert", help="CA certificate of the mirror registry")
    parser.add_argument("--result", help="also write the RESULT json here")
    args = parser.parse_args(argv)
    totals = {"upstream_bytes": 0, "present_bytes": 0}
    started = time.monotonic()
    src, dst = Registry(args.src), Registry(args.dst, args.cacert)
    print(f"copying {args.repo}@{args.ref} from {args.src} to {args.dst}", flush=True)
    digest = copy_manifest(src, dst, args.repo, args.ref, totals, args.tag)
    result = {"digest": digest, **totals, "seconds": round(time.monotonic() - started, 1)}
    if args.result:
        tmp = args.result + ".tmp"
        with open(tmp, "w") as out:
            json.dump(result, out)
        os.replace(tmp, args.result)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
