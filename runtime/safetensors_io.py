"""Byte-level safetensors reading/writing with the standard library only.

Runs inside the serving image (mounted at /host), where we do not want to depend
on the `safetensors` package or torch just to move bytes around.  A safetensors
file is: 8-byte little-endian header length N, N bytes of JSON header (padded
with spaces), then the raw tensor data; each header entry gives dtype, shape and
`data_offsets` [begin, end) relative to the start of the data section.

Everything here streams through fixed-size buffers so the memory used is
independent of tensor size (the hybrid builder's peak-memory guarantee rests on
that).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

# Bytes per element.  F8 types are one byte; safetensors names them
# F8_E4M3 / F8_E5M2 (torch: float8_e4m3fn / float8_e5m2).
DTYPE_SIZES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}

# 8 MiB: large enough that syscalls don't dominate, small enough to be noise
# next to the "largest shard + 1 GiB" budget.
COPY_BUFFER = 8 << 20
# Refuse absurd headers instead of allocating them (a corrupt length prefix).
MAX_HEADER_BYTES = 100 << 20


class SafetensorsError(ValueError):
    """A file is not a well-formed safetensors file."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    # Absolute byte offsets in the file (data-section offset already added).
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class FileHeader:
    path: Path
    tensors: dict[str, TensorInfo]  # in file (data-offset) order
    metadata: dict[str, str]
    data_start: int


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Parse a safetensors header without touching the tensor data."""
    p = Path(path)
    with open(p, "rb") as fh:
        raw_len = fh.read(8)
        if len(raw_len) != 8:
            raise SafetensorsError(f"{p}: shorter than 8 bytes")
        (n,) = struct.unpack("<Q", raw_len)
        if n > MAX_HEADER_BYTES:
            raise SafetensorsError(f"{p}: header length {n} is implausible")
        raw = fh.read(n)
        if len(raw) != n:
            raise SafetensorsError(f"{p}: truncated header")
        file_size = os.fstat(fh.fileno()).st_size
    try:
        hdr = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SafetensorsError(f"{p}: header is not JSON: {exc}") from exc
    data_start = 8 + n
    metadata = hdr.pop("__metadata__", None) or {}
    entries: list[TensorInfo] = []
    for name, e in hdr.items():
        dtype = e["dtype"]
        shape = tuple(int(d) for d in e["shape"])
        b, en = (int(x) for x in e["data_offsets"])
        info = TensorInfo(name, dtype, shape, data_start + b, data_start + en)
        if dtype in DTYPE_SIZES and info.numel * DTYPE_SIZES[dtype] != info.nbytes:
            raise SafetensorsError(f"{p}: {name}: size does not match dtype/shape")
        if info.end > file_size:
            raise SafetensorsError(f"{p}: {name}: data beyond end of file")
        entries.append(info)
    entries.sort(key=lambda t: t.start)
    return FileHeader(p, {t.name: t for t in entries}, dict(metadata), data_start)


def iter_range(fh: BinaryIO, start: int, length: int, bufsize: int = COPY_BUFFER) -> Iterator[bytes]:
    """Yield the bytes [start, start+length) of an open file in bounded chunks."""
    fh.seek(start)
    left = length
    while left > 0:
        chunk = fh.read(min(bufsize, left))
        if not chunk:
            raise SafetensorsError(f"unexpected end of file at {start + length - left}")
        left -= len(chunk)
        yield chunk


def sha256_range(path: str | os.PathLike[str], start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter_range(fh, start, length):
            h.update(chunk)
    return h.hexdigest()


def ranges_equal(a: tuple[Path, int], b: tuple[Path, int], length: int) -> int | None:
    """Compare two byte ranges; return the first differing offset (relative), or None."""
    pos = 0
    with open(a[0], "rb") as fa, open(b[0], "rb") as fb:
        for ca, cb in zip(iter_range(fa, a[1], length), iter_range(fb, b[1], length)):
            if ca != cb:
                for i, (x, y) in enumerate(zip(ca, cb)):
                    if x != y:
                        return pos + i
            pos += len(ca)
    return None


@dataclass(frozen=True)
class TensorSource:
    """Where an output tensor's bytes come from: a range of an existing file,
    or an in-memory blob (used by generators for small tensors)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    path: Path | None = None
    offset: int = 0
    data: bytes | None = None

    @classmethod
    def from_file(cls, info: TensorInfo, path: Path, name: str | None = None) -> "TensorSource":
        return cls(name or info.name, info.dtype, info.shape, info.nbytes, path=path, offset=info.start)

    @classmethod
    def from_bytes(cls, name: str, dtype: str, shape: Iterable[int], data: bytes) -> "TensorSource":
        shp = tuple(int(d) for d in shape)
        return cls(name, dtype, shp, len(data), data=data)


def encode_header(sources: list[TensorSource], metadata: dict[str, str] | None = None) -> bytes:
    """Header bytes (length prefix included) for tensors laid out in list order."""
    hdr: dict[str, object] = {}
    if metadata:
        hdr["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    off = 0
    for s in sources:
        if s.name in hdr:
            raise SafetensorsError(f"duplicate tensor {s.name}")
        hdr[s.name] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [off, off + s.nbytes]}
        off += s.nbytes
    raw = json.dumps(hdr, separators=(",", ":")).encode("utf-8")
    # Pad to 8 bytes so the data section is aligned (what the reference writer does).
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def write_file(
    path: str | os.PathLike[str],
    sources: list[TensorSource],
    metadata: dict[str, str] | None = None,
    on_tensor: Callable[[TensorSource], None] | None = None,
) -> int:
    """Write a safetensors file, copying file-backed tensors through a bounded buffer.

    Returns the file size.  fsyncs before returning so that a later atomic
    rename of the containing directory publishes complete data.
    """
    total = 0
    with open(path, "wb") as out:
        head = encode_header(sources, metadata)
        out.write(head)
        total += len(head)
        open_files: dict[Path, BinaryIO] = {}
        try:
            for s in sources:
                if s.data is not None:
                    out.write(s.data)
                else:
                    assert s.path is not None
                    src = open_files.get(s.path)
                    if src is None:
                        # Sources come mostly from one or two files per output shard.
                        src = open_files[s.path] = open(s.path, "rb")
                    for chunk in iter_range(src, s.offset, s.nbytes):
                        out.write(chunk)
                total += s.nbytes
                if on_tensor is not None:
                    on_tensor(s)
        finally:
            for f in open_files.values():
                f.close()
        out.flush()
        os.fsync(out.fileno())
    return total


def load_index(directory: str | os.PathLike[str]) -> tuple[dict[str, str], dict[str, object]]:
    """(weight_map, metadata) of a checkpoint dir; a single-file checkpoint maps to model.safetensors."""
    d = Path(directory)
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        doc = json.loads(idx.read_text())
        return dict(doc["weight_map"]), dict(doc.get("metadata") or {})
    single = d / "model.safetensors"
    if single.is_file():
        return {n: "model.safetensors" for n in read_header(single).tensors}, {}
    raise FileNotFoundError(f"{d}: no model.safetensors.index.json or model.safetensors")
