"""The one-shot runs of the serving image (downloads, builds): their environment."""

from __future__ import annotations

from sparkfleet.image import MIRROR_READ_TIMEOUT_S, one_shot


def test_a_download_through_an_endpoint_waits_out_a_mirror_s_cold_file():
    """Through the mirror (or hf_endpoint) huggingface_hub's 10 s read timeout is raised: a
    cold file's first clients wait on the mirror's upstream fetch, and a timeout makes them
    ask for the file again. Straight from the hub, huggingface_hub's own timeout stays."""
    mirrored = one_shot("img", "/hf-home", "http://10.0.0.1:8090", "sparkfleet-fetch-x", "/host/fetch_weights.py x")
    assert "-e HF_ENDPOINT=http://10.0.0.1:8090 " in mirrored
    assert f"-e HF_HUB_DOWNLOAD_TIMEOUT={MIRROR_READ_TIMEOUT_S} " in mirrored and MIRROR_READ_TIMEOUT_S > 10
    direct = one_shot("img", "/hf-home", None, "sparkfleet-fetch-x", "/host/fetch_weights.py x")
    assert "HF_ENDPOINT" not in direct and "HF_HUB_DOWNLOAD_TIMEOUT" not in direct
    assert "-e HF_HUB_DISABLE_XET=1 " in mirrored and "-e HF_HUB_DISABLE_XET=1 " in direct
