"""The controller's secrets: the API key made once, private; none means none."""

from __future__ import annotations

from support.fleetdata import defaults

from sparkfleet import credentials
from sparkfleet.config import validate_host_data


def test_auto_api_key_is_generated_once_and_private(tmp_path):
    settings = validate_host_data("s", {**defaults(), "api_key_file": str(tmp_path / "k" / "api-key")})
    first = credentials.api_key(settings)
    assert first and len(first) > 20
    assert credentials.api_key(settings) == first
    assert (tmp_path / "k" / "api-key").stat().st_mode & 0o777 == 0o600


def test_api_key_none_disables_auth():
    assert credentials.api_key(validate_host_data("s", {**defaults(), "api_key": "none"})) is None


def test_a_mirror_certificate_names_its_address_and_is_adopted_privately(tmp_path):
    from sparkfleet.mirrors import Mirror

    mirror = Mirror("spark-1", "10.0.0.11", 8090, 5000, True)
    cert, key = credentials.mirror_tls(str(tmp_path / "made"), mirror)
    assert credentials.names_mirror(cert.read_bytes(), mirror)
    assert not credentials.names_mirror(cert.read_bytes(), Mirror("spark-1", "10.0.0.12", 8090, 5000, True))
    assert not credentials.names_mirror(b"not a certificate", mirror)
    named = Mirror("spark-1", "mirror.lan", 8090, 5000, True)
    assert credentials.names_mirror(credentials.mirror_tls(str(tmp_path / "named"), named)[0].read_bytes(), named)
    kept_dir = tmp_path / "second-checkout"
    credentials.keep_mirror_tls(str(kept_dir), mirror, cert.read_bytes(), key.read_bytes())
    kept_cert, kept_key = credentials.mirror_tls_paths(str(kept_dir), mirror)
    assert kept_cert.read_bytes() == cert.read_bytes() and kept_key.read_bytes() == key.read_bytes()
    assert kept_key.stat().st_mode & 0o777 == 0o600 and kept_dir.stat().st_mode & 0o077 == 0
    assert credentials.mirror_tls(str(kept_dir), mirror) == (kept_cert, kept_key)  # kept, not made again
