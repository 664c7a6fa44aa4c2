"""Variants of the simulated serving image whose vLLM source is edited.

A real serving image is upstream vLLM plus overlays and in-image edits. A variant is the
sim image (the same cached layers, sparkfleet/testbed/image.py) plus one more layer that
replaces some files of its vLLM source with edited copies, pushed to the testbed's
registry under another tag, e.g. to give the fleet an image in which a runtime patch's
anchor is missing::

    variant = push_variant("0.23.0-no-kv-anchor", MISSING_KV_UNIFY_ANCHOR)
    pyinfra ... deploy.py --data image=<variant["pinned"]>
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tarfile

from . import image, paths
from .proc import TestbedError, log
from .registry import RegistryClient, push_image

# kv_unify's anchor (unify_kv_cache_spec_page_size) rewritten to the same effect: what an
# image's own edit of v1/core/kv_cache_utils.py does to a patch that matches text.
MISSING_KV_UNIFY_ANCHOR = {
    "vllm/v1/core/kv_cache_utils.py": (
        "ratio = max_page_size // layer_page_size",
        "ratio = max_page_size // (layer_page_size)",
    ),
}


def vllm_source(relpath: str) -> str:
    """A file of the image's vLLM (``vllm/...``) as the sim image carries it."""
    member = f"vllm-{image.VLLM_VERSION}/{relpath}"
    with tarfile.open(image.ensure_vllm_sdist()) as tar:
        try:
            handle = tar.extractfile(member)
        except KeyError:
            handle = None
        if handle is None:
            raise TestbedError(f"vLLM {image.VLLM_VERSION} has no file {relpath}")
        return handle.read().decode("utf-8")


def edit_layer(edits: dict[str, tuple[str, str]]) -> image.Layer:
    """A layer holding each edited file (``relpath: (old, new)``, ``old`` replaced once)."""
    key = hashlib.sha256(json.dumps([image.VLLM_VERSION, sorted(edits.items())]).encode()).hexdigest()[:16]
    stage = paths.CACHE_DIR / f"image-variant-stage-{key}"
    shutil.rmtree(stage, ignore_errors=True)
    site = stage / f"usr/local/lib/python{image.IMAGE_PYTHON}/dist-packages"
    try:
        for relpath, (old, new) in sorted(edits.items()):
            text = vllm_source(relpath)
            if text.count(old) != 1:
                raise TestbedError(f"{relpath}: expected {old!r} once, found it {text.count(old)} times")
            out = site / relpath
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(text.replace(old, new, 1), encoding="utf-8")
        for p in [stage, *stage.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        return image.write_layer(stage, paths.CACHE_DIR / f"image-variant-{key}.tar.gz")
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def push_variant(tag: str, edits: dict[str, tuple[str, str]]) -> dict:
    """Push the sim image plus a layer with ``edits`` as ``<registry>/<repo>:<tag>``;
    {ref, digest, pinned} like ``image.publish``, and ``id`` (what docker calls the image)."""
    config, layers = image.build()
    extra = edit_layer(edits)
    doc = json.loads(config)
    doc["rootfs"]["diff_ids"].append(extra.diff_id)
    doc["history"].append({"created": image.CREATED,
                           "created_by": "sparkfleet testbed: edited vllm " + ", ".join(sorted(edits))})
    doc["config"]["Labels"]["org.opencontainers.image.title"] += f" ({tag})"
    variant_config = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    client = RegistryClient(f"http://{paths.REGISTRY}")
    digest = push_image(client, paths.IMAGE_REPO, tag, variant_config,
                        [(l.blob, l.digest, l.size) for l in [*layers, extra]])  # noqa: E741
    ref = f"{paths.REGISTRY}/{paths.IMAGE_REPO}:{tag}"
    log(f"pushed variant {ref} ({', '.join(sorted(edits))} edited; layer {extra.digest[:19]})")
    return {"ref": ref, "digest": digest, "pinned": f"{ref}@{digest}",
            "id": "sha256:" + hashlib.sha256(variant_config).hexdigest()}
