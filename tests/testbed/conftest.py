"""Shared by the testbed tests."""
from __future__ import annotations

import pytest
from huggingface_hub import constants


@pytest.fixture(autouse=True)
def http_downloads(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process downloads take the HTTP path, as the deploy's do (HF_HUB_DISABLE_XET=1):
    the testbed hub answers like the Hub, Xet included, but its CAS holds nothing. Tests
    of the Xet path run the client in a subprocess with its own environment."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
