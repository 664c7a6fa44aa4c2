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
    model = deletion({"kind": "model", "name": DRAFTER, "pin": "1" * 40}, "/m", "10.0.0.1:5000")
    assert model.startswith("rm -rf ")
    for path in (f"/m/hf/repos/files/models/{DRAFTER}/resolve/{'1' * 40}",
                 f"/m/hf/repos/heads/models/{DRAFTER}/resolve_head/{'1' * 40}",
                 f"/m/hf/repos/api/models/{DRAFTER}/tree/{'1' * 40}", f"/m/held/z-lab--Qwen3.5-122B-A10B-DFlash@{'1' * 40}"):
        assert path in model
    image = deletion({"kind": "image", "name": IMAGE, "pin": "sha256:" + "b" * 64}, "/m", "10.0.0.1:5000")
    assert "-X DELETE" in image and f"https://10.0.0.1:5000/v2/{IMAGE}/manifests/sha256:{'b' * 64}" in image


def test_the_mirror_asks_its_hf_mirror_for_every_file_of_a_commit_and_marks_it_held(tmp_path):
    """The hold program against a hub that answers as olah does (revision, tree, resolve)."""
    import subprocess
    import sys

    from sparkfleet.mirror.keep import _HOLD_PY
    from sparkfleet.testbed.hub import HubServer

    commit = "1" * 40
    (tmp_path / "repos" / DRAFTER / commit / "sub").mkdir(parents=True)
    (tmp_path / "repos" / DRAFTER / commit / "model.safetensors").write_bytes(b"w" * 5000)
    (tmp_path / "repos" / DRAFTER / commit / "sub" / "a b.json").write_text("{}")
    (tmp_path / "hf.env").write_text("HF_TOKEN=hf_token_of_the_fleet_0123456789\n")
    marker = tmp_path / "held" / f"z-lab--Qwen3.5-122B-A10B-DFlash@{commit}"

    def hold(url: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _HOLD_PY, url, DRAFTER, commit, str(marker), str(tmp_path / "hf.env")],
                              capture_output=True, text=True, timeout=60)

    with HubServer(tmp_path / "repos", "127.0.0.1", 0, token="hf_token_of_the_fleet_0123456789") as hub:
        hub.inject_abort(DRAFTER, "model.safetensors", 1000)  # one connection cut mid-file: asked again
        done = hold(hub.url)
        assert done.returncode == 0 and f"the mirror holds {DRAFTER}@{commit}: 2 files" in done.stdout, done
        assert f"asking again in 3 s for /{DRAFTER}/resolve/{commit}/model.safetensors" in done.stdout, done
        assert marker.read_text() == "2 files\n" and hub.stats()["total"] == 1000 + 5002
        hub.move_ref(DRAFTER)
        hub.delete_revision(DRAFTER, commit)
        marker.unlink()
        gone = hold(hub.url)
    # Reported, the mirror host not failed, nothing marked: the next deploy tries again.
    assert gone.returncode == 0 and gone.stdout.startswith(f"report: the mirror does not hold every file of {DRAFTER}@")
    assert not marker.exists() and "hf_token_of_the_fleet" not in gone.stdout + gone.stderr
