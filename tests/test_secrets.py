"""The controller's secrets: the API key made once, private; none means none."""

from __future__ import annotations

from support.fleetdata import defaults

from sparkfleet import secrets
from sparkfleet.config import validate_host_data


def test_auto_api_key_is_generated_once_and_private(tmp_path):
    settings = validate_host_data("s", {**defaults(), "api_key_file": str(tmp_path / "k" / "api-key")})
    first = secrets.api_key(settings)
    assert first and len(first) > 20
    assert secrets.api_key(settings) == first
    assert (tmp_path / "k" / "api-key").stat().st_mode & 0o777 == 0o600


def test_api_key_none_disables_auth():
    assert secrets.api_key(validate_host_data("s", {**defaults(), "api_key": "none"})) is None
