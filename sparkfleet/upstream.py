"""Upstream, asked from the controller: the hub for the commit a revision names, the
image's registry for the manifest digest a tag names, and the bytes of each. Asked only
when a reference enters sparkfleet.lock or is moved (:mod:`sparkfleet.fleetlock`).
"""

from __future__ import annotations

import functools
import hashlib
import re
from urllib.parse import quote, urlencode

from sparkfleet.facts import MANIFEST_ACCEPT
from sparkfleet.imagename import ImageName
from sparkfleet.lockfile import COMMIT, LOCK_NAME


class Unresolved(Exception):
    """Upstream did not answer for a reference: what went wrong, and ``fix``."""

    def __init__(self, what: str, fix: str) -> None:
        super().__init__(what)
        self.fix = fix


def _unreachable(where: str, exc: Exception) -> Unresolved:
    return Unresolved(f"the controller cannot reach {where} ({type(exc).__name__})",
                      f"let the controller reach {where} (it asks once, when a reference enters {LOCK_NAME}), "
                      "or pin the reference (a digest, a commit)")


class Upstream:
    """The hub and the image's registry, asked from the controller (``requests``)."""

    def __init__(self, timeout: float = 30) -> None:
        self.timeout = timeout

    @functools.cached_property
    def http(self):
        """One ``requests`` session, made when first asked: a run whose lock is complete asks
        nothing, and importing requests costs every run ~0.1 s."""
        import requests

        return requests.Session()

    def model(self, endpoint: str, repo: str, revision: str, token: str | None) -> tuple[str, int | None]:
        """(commit, bytes of its files) of ``repo@revision`` at the hub ``endpoint``."""
        import requests

        url = f"{endpoint}/api/models/{repo}/revision/{quote(revision, safe='')}"
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        try:
            answer = self.http.get(url, params={"blobs": "true"}, headers=headers, timeout=self.timeout)
        except requests.RequestException as exc:
            raise _unreachable(endpoint, exc) from None
        code = answer.headers.get("X-Error-Code", "")
        if answer.status_code == 404 and code == "RevisionNotFound":
            raise Unresolved(f"{repo} has no revision {revision!r} at {endpoint}",
                             "set model_revisions to a branch, tag or commit of it")
        if answer.status_code in (401, 403, 404):
            raise Unresolved(f"{endpoint} does not show {repo} (HTTP {answer.status_code}{' ' + code if code else ''})",
                             "check the repo id, and hf_token (else the controller's HF_TOKEN)")
        if answer.status_code != 200:
            raise Unresolved(f"{endpoint} answered HTTP {answer.status_code} for {repo}@{revision}",
                             "try again, or pin the revision to a commit")
        doc = answer.json()
        commit = str(doc.get("sha") or "")
        if not COMMIT.match(commit):
            raise Unresolved(f"{endpoint} gave no commit for {repo}@{revision}", "pin the revision to a commit")
        sizes = [s.get("size", (s.get("lfs") or {}).get("size")) for s in doc.get("siblings") or []]
        return commit, (sum(sizes) if sizes and all(isinstance(n, int) for n in sizes) else None)

    def image(self, registry_url: str, reference: str) -> tuple[str, int | None]:
        """(manifest digest, compressed bytes) of ``reference``'s tag or digest at the
        registry ``registry_url`` (anonymously, or with the token its challenge offers)."""
        name = ImageName.parse(reference)
        doc, digest = self._manifest(registry_url, name.path, name.digest or name.tag or "latest")
        size = None
        if "manifests" in doc:  # an index: the arm64 image's size (a Spark is arm64)
            children = doc["manifests"]
            arm = [m for m in children if (m.get("platform") or {}).get("architecture") == "arm64"]
            child = (arm or children or [{}])[0].get("digest")
            doc = self._manifest(registry_url, name.path, child)[0] if child else {}
        if "layers" in doc:
            size = int(doc.get("config", {}).get("size", 0)) + sum(int(layer["size"]) for layer in doc["layers"])
        return digest, size

    def _manifest(self, registry_url: str, path: str, reference: str) -> tuple[dict, str]:
        import requests

        url = f"{registry_url}/v2/{path}/manifests/{reference}"
        headers = {"Accept": MANIFEST_ACCEPT}
        try:
            answer = self.http.get(url, headers=headers, timeout=self.timeout)
            challenge = answer.headers.get("WWW-Authenticate", "")
            if answer.status_code == 401 and challenge.lower().startswith("bearer "):
                params = dict(re.findall(r'(\w+)="([^"]*)"', challenge))
                realm = params.pop("realm", "")
                got = self.http.get(realm + "?" + urlencode(params), timeout=self.timeout)
                token = (got.json() if got.ok else {}).get("token") or ""
                answer = self.http.get(url, headers={**headers, "Authorization": f"Bearer {token}"},
                                       timeout=self.timeout)
        except requests.RequestException as exc:
            raise _unreachable(registry_url, exc) from None
        if answer.status_code == 404:
            raise Unresolved(f"{registry_url} has no image {path}:{reference}", "fix `image` (its tag or digest)")
        if answer.status_code in (401, 403):
            raise Unresolved(f"{registry_url} refused to show {path}:{reference} to the controller (HTTP "
                             f"{answer.status_code}, a private registry?)", "pin `image` as name@sha256:<digest>")
        if answer.status_code != 200:
            raise Unresolved(f"{registry_url} answered HTTP {answer.status_code} for {path}:{reference}",
                             "try again, or pin `image` as name@sha256:<digest>")
        digest = answer.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(answer.content).hexdigest()
        return answer.json(), digest

