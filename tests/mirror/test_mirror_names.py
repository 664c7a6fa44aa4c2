"""The references hosts pull from the mirror (no fleet)."""

from __future__ import annotations

from support.fleetdata import defaults

from sparkfleet.config import validate_host_data
from sparkfleet.mirror import image_reference, local_image
from sparkfleet.mirrors import Mirror


def test_hosts_run_the_fleet_registrys_copy_with_the_same_pin():
    settings = validate_host_data("spark-2", {**defaults(), "image": "ghcr.io/a/b:1@sha256:" + "c" * 64})
    mirror = Mirror("spark-1", "10.0.0.11", 8090, 5000, False)
    assert image_reference(settings, mirror) == "10.0.0.11:5000/a/b:1@sha256:" + "c" * 64


def test_hosts_run_the_image_by_a_local_name_that_no_mirror_address_changes():
    pinned = validate_host_data("spark-2", {**defaults(), "image": "ghcr.io/a/b:1@sha256:" + "c" * 64})
    assert local_image(pinned) == "localhost/sparkfleet/serve:sha256-" + "c" * 64
    # The tag does not matter once pinned; an unpinned image is named by its reference.
    assert local_image(validate_host_data("h", {**defaults(), "image": "ghcr.io/a/b:2@sha256:" + "c" * 64})) == \
        local_image(pinned)
    tagged = [local_image(validate_host_data("h", {**defaults(), "image": f"ghcr.io/a/b:{t}"})) for t in ("1", "2")]
    assert tagged[0] != tagged[1] and all(t.startswith("localhost/sparkfleet/serve:ref-") for t in tagged)
    assert all(len(t.split(":", 1)[1]) <= 128 for t in [*tagged, local_image(pinned)])  # docker's tag limit
