"""The tensors of a safetensors file as views of its memory-mapped bytes: nothing is copied
until the caller converts a view into its own layout, so an adapter read costs one pass
over the page cache (file -> host copy) instead of three (file -> tensor -> float32 ->
host copy).

    [u64 little-endian N][N bytes of JSON header][data]
    header: {key: {"dtype": "BF16", "shape": [r, k], "data_offsets": [begin, end]}, ...}

Offsets are relative to the start of the data; every entry is checked against the file
size and its shape before a view is made. The mapping is private (copy-on-write) and
never written; a view must not outlive the `SafetensorsViews` it came from.
"""
from __future__ import annotations

import json
import math
import mmap
import os
import struct

import torch

from engine.errors import AdapterError

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "F64": torch.float64}
_MAX_HEADER = 100 << 20


class SafetensorsViews:
    """`get(key)` -> a tensor viewing the file's bytes. Use as a context manager."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < 8:
                self._fail(f"file of {size} bytes holds no safetensors header")
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        (n,) = struct.unpack("<Q", self._mm[:8])
        if n > min(_MAX_HEADER, size - 8):
            self._fail(f"header length {n} exceeds the file ({size} bytes)")
        try:
            header = json.loads(self._mm[8:8 + n])
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            self._fail(f"header is not valid JSON: {e}")
        if not isinstance(header, dict):
            self._fail("header is not a JSON object")
        header.pop("__metadata__", None)
        self._header = header
        self._data_start = 8 + n
        self._data_len = size - 8 - n

    def _fail(self, what: str):
        raise AdapterError(f"not a readable safetensors file: {what}", feature="safetensors",
                           file=self.path)

    def get(self, key: str) -> torch.Tensor:
        entry = self._header.get(key)
        if not isinstance(entry, dict):
            self._fail(f"no tensor {key!r}")
        dtype = DTYPES.get(entry.get("dtype"))
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if dtype is None:
            self._fail(f"tensor {key!r} has dtype {entry.get('dtype')!r}")
        if not (_ints(shape) and _ints(offsets) and len(offsets) == 2):
            self._fail(f"tensor {key!r} has a malformed shape or data_offsets")
        begin, end = offsets
        itemsize = torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= self._data_len or \
                end - begin != math.prod(shape) * itemsize:
            self._fail(f"tensor {key!r}: data_offsets {offsets} do not fit shape {shape} "
                       f"in {self._data_len} bytes of data")
        count = (end - begin) // itemsize
        if count == 0:
            return torch.empty(shape, dtype=dtype)
        flat = torch.frombuffer(self._mm, dtype=dtype, count=count,
                                offset=self._data_start + begin)
        return flat.view(shape)

    def close(self) -> None:
        self._header = {}
        try:
            self._mm.close()
        except BufferError:  # a view is still alive: the mapping goes with the last one
            pass

    def __enter__(self) -> "SafetensorsViews":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ints(v) -> bool:
    return isinstance(v, list) and all(isinstance(i, int) and not isinstance(i, bool)
                                       and i >= 0 for i in v)
