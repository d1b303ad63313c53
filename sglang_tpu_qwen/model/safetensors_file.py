"""One safetensors file: its header validated before any use, its tensors as memory-mapped numpy views.

Format (https://huggingface.co/docs/safetensors, "Format"): 8-byte little-endian header length N, N bytes
of UTF-8 JSON ``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``, then the
data; offsets are relative to the data start (byte 8 + N). A file that does not satisfy this (truncated,
corrupted header, unknown dtype, offsets outside the file or overlapping, byte length other than
``prod(shape) * itemsize``) raises :class:`CheckpointError` naming the file and the tensor, before any
tensor byte is handed to numpy or JAX.

Reading does not go through ``safetensors.safe_open``: after validation the file is memory-mapped once
and tensors are zero-copy views of the mapping (bf16 / fp8 come from ``ml_dtypes``), so the loader reads
each byte once and an optional :class:`FileDigest` hashes those same bytes as they are consumed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import mmap
import os
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

# The safetensors library refuses headers above 100 MB (safetensors/src/tensor.rs, MAX_HEADER_SIZE).
MAX_HEADER_BYTES = 100_000_000

DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.bool_), "U8": np.dtype(np.uint8), "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16), "I16": np.dtype(np.int16), "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16), "U32": np.dtype(np.uint32), "I32": np.dtype(np.int32),
    "F32": np.dtype(np.float32), "U64": np.dtype(np.uint64), "I64": np.dtype(np.int64),
    "F64": np.dtype(np.float64), "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
}  # fmt: skip
FP8_DTYPES = frozenset({"F8_E4M3", "F8_E5M2"})


class CheckpointError(ValueError):
    """The checkpoint does not match the config: missing, unexpected or mis-shaped tensor, bad files."""


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One header entry. ``begin`` / ``end``: byte offsets from the start of the file (not of the data)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _bad(path: Path, what: str) -> CheckpointError:
    return CheckpointError(f"{path.name}: {what} (corrupted or truncated safetensors file {path})")


def read_header(path: Path) -> tuple[dict[str, TensorInfo], int]:
    """Parse and validate the header of ``path``.

    Returns ``({name: TensorInfo}, header_end)`` where ``header_end = 8 + N`` is the first data byte.

    Raises:
        CheckpointError: the file is shorter than its header, the header is not a JSON object of valid
            entries, a dtype is unknown, a shape is not a list of non-negative ints, a tensor's bytes
            lie outside the file, overlap another tensor's, or do not number ``prod(shape) * itemsize``.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise _bad(path, f"{size} bytes, shorter than the 8-byte header length")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise _bad(path, f"header length {n} does not fit the file's {size} bytes")
        raw = fh.read(n)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise _bad(path, f"header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")
    data_start, data_len = 8 + n, size - 8 - n
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise _bad(path, f"tensor {name}: header entry {entry!r} lacks dtype / shape / data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if dtype not in DTYPES:
            raise _bad(path, f"tensor {name}: unknown dtype {dtype!r} (known: {', '.join(DTYPES)})")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise _bad(path, f"tensor {name}: shape {shape!r} is not a list of non-negative integers")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                or not 0 <= offsets[0] <= offsets[1]):
            raise _bad(path, f"tensor {name}: data_offsets {offsets!r} are not [begin, end] with begin <= end")
        begin, end = offsets
        if end > data_len:
            raise _bad(path, f"tensor {name}: data_offsets [{begin}, {end}] point past the end of the data "
                             f"({data_len} bytes after the header)")
        want = math.prod(shape) * DTYPES[dtype].itemsize
        if end - begin != want:
            raise _bad(path, f"tensor {name}: {end - begin} data bytes, but shape {tuple(shape)} of {dtype} "
                             f"needs {want}")
        infos[name] = TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
    ordered = sorted(infos.values(), key=lambda t: (t.begin, t.end))
    for a, b in zip(ordered, ordered[1:], strict=False):
        if b.begin < a.end:
            raise _bad(path, f"tensors {a.name} and {b.name} overlap (bytes [{a.begin}, {a.end}) and "
                             f"[{b.begin}, {b.end}))")
    return infos, data_start


class FileDigest:
    """sha256 of one file, fed by the loader's own reads (one pass over the bytes).

    The loader reports each byte range it has read (:meth:`consumed`); the digest advances over the
    contiguous prefix it has been given and hashes those bytes from the same memory map, right after
    the read, while they are in the page cache. Ranges read ahead of the prefix wait (only their offsets
    are kept) until the gap before them is read. :meth:`hexdigest` hashes whatever the loader never read
    (skipped tensors, padding) and returns the digest.
    """

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._sha = hashlib.sha256()
        self._pos = 0
        self._ahead: dict[int, int] = {}  # begin -> end of ranges read past the hashed prefix

    def consumed(self, begin: int, end: int) -> None:
        if end <= self._pos:
            return
        if begin > self._pos:
            self._ahead[begin] = max(end, self._ahead.get(begin, end))
            return
        self._advance(end)
        while True:
            nxt = [b for b in self._ahead if b <= self._pos]
            if not nxt:
                return
            for b in nxt:
                self._advance(self._ahead.pop(b))

    def _advance(self, end: int) -> None:
        if end > self._pos:
            self._sha.update(self._view[self._pos : end])
            self._pos = end

    def hexdigest(self) -> str:
        self._ahead.clear()
        self._advance(len(self._view))
        return self._sha.hexdigest()


class SafetensorsFile:
    """A validated, memory-mapped safetensors file (context manager).

    ``tensors``: header entries by name. :meth:`get` returns a read-only numpy view (no copy) and, when
    ``hash_bytes`` is set, feeds the bytes it hands out to :attr:`digest`.
    """

    def __init__(self, path: str | os.PathLike[str], *, hash_bytes: bool = False) -> None:
        self.path = Path(path)
        self.tensors, self.data_start = read_header(self.path)
        self.hash_bytes = hash_bytes
        self._fh: Any = None
        self._mm: mmap.mmap | None = None
        self._view: memoryview | None = None
        self.digest: FileDigest | None = None

    def open(self) -> SafetensorsFile:
        if self._view is None:
            self._fh = open(self.path, "rb")
            if os.fstat(self._fh.fileno()).st_size:
                self._mm = mmap.mmap(self._fh.fileno(), 0, access=mmap.ACCESS_READ)
                self._view = memoryview(self._mm)
            else:
                self._view = memoryview(b"")
            if self.hash_bytes:
                self.digest = FileDigest(self._view)
                self.digest.consumed(0, self.data_start)  # the header, read above
        return self

    def close(self) -> None:
        # numpy views of the map may outlive the file object; the map closes when the last one is gone.
        self._view = None
        self._mm = None
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def __enter__(self) -> SafetensorsFile:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, name: str) -> np.ndarray:
        """Tensor ``name`` as a read-only numpy view of the file (bf16 / fp8 as ml_dtypes). KeyError if absent."""
        info = self.tensors[name]
        self.open()
        assert self._view is not None
        arr = np.frombuffer(self._view[info.begin : info.end], dtype=DTYPES[info.dtype]).reshape(info.shape)
        if self.digest is not None:
            self.digest.consumed(info.begin, info.end)
        return arr

    def sha256(self) -> str:
        """Hex digest of the whole file: the bytes :meth:`get` handed out, then the rest."""
        self.open()
        if self.digest is None:
            self.digest = FileDigest(self._view)  # type: ignore[arg-type]
        return self.digest.hexdigest()
