"""What the mirror keeps for the fleet lock, as the lock moves (no fleet): the locked
artifacts, ``mirror_keep_previous`` before them per repository, most recent first; what it
deletes, and how."""

from __future__ import annotations

from sparkfleet.mirror.keep import deletion, disk, next_record

GIB = 1024**3
DRAFTER = "z-lab/Qwen3.5-122B-A10B-DFlash"
IMAGE = "aeon-7/aeon-vllm-ultimate"


def locked(drafter: str, image: str = "sha256:" + "a" * 64) -> list[dict]:
    return [{"kind": "image", "name": IMAGE, "pin": image, "size": 21 * GIB},
            {"kind": "model", "name": DRAFTER, "pin": drafter, "size": 2 * GIB}]


def pins(record: dict, key: str) -> list[str]:
    return [a["pin"] for a in record[key]]


def test_the_lock_moving_keeps_the_previous_ones_and_deletes_the_oldest():
    first, deleted = next_record({}, locked("1" * 40), keep_previous=1)
    assert deleted == [] and pins(first, f"model {DRAFTER}") == ["1" * 40]
    second, deleted = next_record(first, locked("2" * 40), keep_previous=1)
    assert deleted == [] and pins(second, f"model {DRAFTER}") == ["2" * 40, "1" * 40]
    third, deleted = next_record(second, locked("3" * 40), keep_previous=1)
    assert pins(third, f"model {DRAFTER}") == ["3" * 40, "2" * 40]
    assert deleted == [{"kind": "model", "name": DRAFTER, "pin": "1" * 40, "size": 2 * GIB}]
    # A converged run: the same record, nothing deleted.
    assert next_record(third, locked("3" * 40), keep_previous=1) == (third, [])
    # A rollback to the previous lock (from version control) keeps the newer as previous.
    back, deleted = next_record(third, locked("2" * 40), keep_previous=1)
    assert pins(back, f"model {DRAFTER}") == ["2" * 40, "3" * 40] and deleted == []


def test_keep_previous_zero_deletes_at_once_and_a_repository_no_longer_locked_keeps_its_last():
    first, _ = next_record({}, locked("1" * 40), keep_previous=0)
    moved, deleted = next_record(first, locked("2" * 40), keep_previous=0)
    assert [a["pin"] for a in deleted] == ["1" * 40]
    gone, deleted = next_record(moved, locked("2" * 40)[:1], keep_previous=1)  # the drafter left the lock
    assert pins(gone, f"model {DRAFTER}") == ["2" * 40] and deleted == []


def test_what_it_takes_is_said_locked_and_previous_apart():
    record, _ = next_record(next_record({}, locked("1" * 40), 1)[0], locked("2" * 40), 1)
    assert disk(record, locked("2" * 40)) == "2 locked (23.00 GiB), 1 previous (2.00 GiB)"


def test_a_commit_leaves_olah_s_cache_and_an_image_the_registry_through_its_api():
    model = deletion({"kind": "model", "name": DRAFTER, "pin": "1" * 40}, "/m/hf/repos", "10.0.0.1:5000")
    assert model.startswith("rm -rf ")
    for path in (f"/m/hf/repos/files/models/{DRAFTER}/resolve/{'1' * 40}",
                 f"/m/hf/repos/heads/models/{DRAFTER}/resolve_head/{'1' * 40}",
                 f"/m/hf/repos/api/models/{DRAFTER}/tree/{'1' * 40}"):
        assert path in model
    image = deletion({"kind": "image", "name": IMAGE, "pin": "sha256:" + "b" * 64}, "/m/hf/repos", "10.0.0.1:5000")
    assert "-X DELETE" in image and f"https://10.0.0.1:5000/v2/{IMAGE}/manifests/sha256:{'b' * 64}" in image
