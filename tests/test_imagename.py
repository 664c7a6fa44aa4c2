"""Image references split as registries see them, and where an image comes from (no fleet)."""

from __future__ import annotations

import pytest

from sparkfleet.imagename import ImageName, upstream_registry_url


@pytest.mark.parametrize("reference,expected", [
    ("ghcr.io/aeon-7/vllm:2026-06-18", ("ghcr.io", "aeon-7/vllm", "2026-06-18", None)),
    ("10.213.0.1:5000/sparkfleet/vllm-sim:0.23.0@sha256:" + "a" * 64,
     ("10.213.0.1:5000", "sparkfleet/vllm-sim", "0.23.0", "sha256:" + "a" * 64)),
    ("vllm/vllm-openai", ("docker.io", "vllm/vllm-openai", "latest", None)),
    ("ubuntu@sha256:" + "b" * 64, ("docker.io", "library/ubuntu", None, "sha256:" + "b" * 64)),
    ("localhost:5000/x:1", ("localhost:5000", "x", "1", None)),
])
def test_image_names(reference, expected):
    name = ImageName.parse(reference)
    assert (name.registry, name.path, name.tag, name.digest) == expected


def test_another_registry_keeps_the_path_tag_and_digest():
    assert ImageName.parse("ghcr.io/a/b:1@sha256:" + "c" * 64).at("10.0.0.11:5000") == \
        "10.0.0.11:5000/a/b:1@sha256:" + "c" * 64
    assert ImageName.parse("ubuntu").at("mirror:5000") == "mirror:5000/library/ubuntu:latest"


def test_an_image_comes_from_its_own_registry_unless_image_registry_url_says_otherwise():
    assert upstream_registry_url("vllm/vllm-openai:v1", None) == "https://registry-1.docker.io"
    assert upstream_registry_url("ghcr.io/a/b:1", None) == "https://ghcr.io"
    assert upstream_registry_url("ghcr.io/a/b:1", "http://10.0.0.5:5000/") == "http://10.0.0.5:5000"
