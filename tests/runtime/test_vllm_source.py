"""tests/support/vllm_source.py: real sdists, fetched once, members extracted lazily."""
from __future__ import annotations

import pytest
from support import vllm_source as vs


def test_cache_root_respects_env(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("SPARKFLEET_CACHE", str(tmp_path))
    assert vs.cache_root() == tmp_path / "vllm"
    monkeypatch.delenv("SPARKFLEET_CACHE")
    assert vs.cache_root().parts[-3:] == (".cache", "sparkfleet", "vllm")


@pytest.mark.network
@pytest.mark.parametrize("version", vs.VLLM_TEST_VERSIONS)
def test_cached_members_need_no_network(version: str, monkeypatch) -> None:
    vs.vllm_source_file(version, "vllm/_version.py")  # warm (may download once)

    def offline(*a, **k):
        raise AssertionError("network used although everything is cached")

    monkeypatch.setattr(vs.requests, "get", offline)
    path = vs.vllm_source_file(version, "vllm/_version.py")
    assert f"'{version}'" in path.read_text()
    assert vs.vllm_sdist(version).name == f"vllm-{version}.tar.gz"


@pytest.mark.network
def test_missing_member_is_a_clear_error() -> None:
    with pytest.raises(vs.VllmSourceError, match="no member"):
        vs.vllm_source_file(vs.VLLM_IMAGE_VERSION, "vllm/does/not/exist.py")


@pytest.mark.network
def test_layout_differences_are_real() -> None:
    """The moves the capability gates rely on are in the real sdists."""
    old, new = vs.VLLM_IMAGE_VERSION, vs.VLLM_NEWEST_VERSION
    assert vs.vllm_has_file(old, "vllm/model_executor/layers/quantization/inc.py")
    assert vs.vllm_has_file(new, "vllm/model_executor/layers/quantization/inc/inc.py")
    assert not vs.vllm_has_file(old, "vllm/v1/core/kv_cache_planning.py")
    assert vs.vllm_has_file(new, "vllm/v1/core/kv_cache_planning.py")
