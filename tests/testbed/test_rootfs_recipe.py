"""The host root's recipe (no root needed): its hash names the cached root."""
from __future__ import annotations

from sparkfleet.testbed import rootfs


def test_docker_from_a_newer_suite_is_a_recipe_of_its_own(monkeypatch):
    plain = rootfs.host_recipe(mirror="http://m")
    assert "docker_from" not in plain  # the bookworm root keeps the hash it had
    monkeypatch.setattr(rootfs, "HOST_DOCKER_FROM", "forky")
    newer = rootfs.host_recipe(mirror="http://m")
    assert newer["docker_from"] == "forky"
    assert rootfs.cached_path(newer) != rootfs.cached_path(plain)


def test_the_image_root_has_ca_certificates():
    """hf_xet builds no HTTP client without a CA bundle: the Xet path would be hidden."""
    assert "ca-certificates" in rootfs.image_recipe(mirror="http://m")["include"]
