"""The simulated serving image is built deterministically (no root needed)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from sparkfleet.testbed import image, registry


def _tree(root: Path, order: list[str], mtime: float) -> None:
    files = {"usr/local/bin/vllm": b"#!/usr/bin/python3\nprint('hi')\n",
             "usr/local/lib/python3.11/dist-packages/a/__init__.py": b"x = 1\n",
             "usr/local/lib/python3.11/dist-packages/b.py": b"y = 2\n",
             "etc/hello": b"hello\n"}
    for rel in order:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(files[rel])
        p.chmod(0o755 if rel.endswith("vllm") else 0o644)
    (root / "usr/bin").mkdir(parents=True, exist_ok=True)
    os.symlink("../local/bin/vllm", root / "usr/bin/vllm-link")
    os.link(root / "etc/hello", root / "etc/hello-hardlink")
    for p in [root, *root.rglob("*")]:
        os.utime(p, (mtime, mtime), follow_symlinks=False)


def test_layer_digest_is_independent_of_mtime_and_creation_order(tmp_path):
    names = ["usr/local/bin/vllm", "usr/local/lib/python3.11/dist-packages/a/__init__.py",
             "usr/local/lib/python3.11/dist-packages/b.py", "etc/hello"]
    a, b = tmp_path / "a", tmp_path / "b"
    _tree(a, names, time.time())
    _tree(b, list(reversed(names)), 1_000_000_000)
    la = image.write_layer(a, tmp_path / "a.tar.gz")
    lb = image.write_layer(b, tmp_path / "b.tar.gz")
    assert la.digest == lb.digest and la.diff_id == lb.diff_id
    assert (tmp_path / "a.tar.gz").read_bytes() == (tmp_path / "b.tar.gz").read_bytes()
    # a content change changes it
    (b / "etc/hello").write_bytes(b"hello!\n")
    assert image.write_layer(b, tmp_path / "c.tar.gz").diff_id != la.diff_id


def test_layer_entries_are_normalised(tmp_path):
    import tarfile

    _tree(tmp_path / "r", ["etc/hello", "usr/local/bin/vllm", "usr/local/lib/python3.11/dist-packages/b.py",
                           "usr/local/lib/python3.11/dist-packages/a/__init__.py"], time.time())
    image.write_layer(tmp_path / "r", tmp_path / "l.tar.gz")
    with tarfile.open(tmp_path / "l.tar.gz") as tar:
        members = tar.getmembers()
    names = [m.name for m in members]
    assert names[0] == "etc" and "usr/local/bin/vllm" in names
    assert all(m.mtime == image.EPOCH and m.uname == "" and m.gname == "" for m in members)
    assert any(m.islnk() for m in members) and any(m.issym() for m in members)


def test_manifest_and_config_are_canonical(tmp_path):
    layer = image.Layer(str(tmp_path / "x"), "sha256:" + "1" * 64, "sha256:" + "2" * 64, 10, 20)
    c1 = image.config_bytes([layer])
    assert c1 == image.config_bytes([layer])
    cfg = json.loads(c1)
    assert cfg["rootfs"]["diff_ids"] == ["sha256:" + "2" * 64]
    assert cfg["config"]["Cmd"] == ["vllm", "serve"] and "Entrypoint" not in cfg["config"]
    m = registry.manifest_bytes(c1, [(Path("x"), layer.digest, layer.size)])
    assert m == registry.manifest_bytes(c1, [(Path("y"), layer.digest, layer.size)])
    doc = json.loads(m)
    assert doc["mediaType"] == registry.MANIFEST_V2 and doc["layers"][0]["size"] == 10
    assert b" " not in m
