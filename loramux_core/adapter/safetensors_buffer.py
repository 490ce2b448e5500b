"""A safetensors file held in memory: the header checked strictly, tensors viewed in place.

Layout (https://huggingface.co/docs/safetensors): an 8-byte little-endian header length N,
N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__":
{str: str}}`, then the data. Every claim of the header is checked against the bytes before
any tensor is built: known dtype, non-negative integer shape, `end - begin` equal to the
shape's byte size, and the tensors tiling the data exactly (sorted, no gap, no overlap, no
byte left over), as the safetensors library itself requires. Nothing here imports torch
(engine/lora/tensor_view.py views the tensors), so the control plane can check headers
cheaply.
"""
from __future__ import annotations

import json
import math
from typing import NamedTuple

from loramux_core.errors import AdapterError


MAX_HEADER_BYTES = 100 << 20  # the safetensors library's own limit
ITEM_SIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
_FLOATS = ("F16", "BF16", "F32", "F64")


class TensorInfo(NamedTuple):
    dtype: str
    shape: tuple[int, ...]
    start: int   # absolute byte offsets in the file
    end: int


def _bad(why: str, file: str) -> AdapterError:
    return AdapterError(f"not a valid safetensors file: {why}", feature="safetensors", file=file)


def parse_header(buf: bytes, file: str, size: int | None = None) -> dict[str, TensorInfo]:
    """{name: TensorInfo} of the safetensors bytes `buf` (the whole file, or its first
    bytes through the header when `size`, the file's size, is given);
    AdapterError(feature="safetensors") naming the first lie or inconsistency."""
    size = len(buf) if size is None else size
    if size < 8:
        raise _bad(f"{size} bytes, shorter than the 8-byte header length", file)
    n = int.from_bytes(buf[:8], "little")
    if n > min(MAX_HEADER_BYTES, size - 8) or len(buf) < 8 + n:
        raise _bad(f"header length {n} exceeds the file ({size} bytes) or the "
                   f"{MAX_HEADER_BYTES}-byte limit", file)
    try:
        header = json.loads(bytes(buf[8:8 + n]).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _bad(f"header is not JSON ({type(e).__name__})", file) from None
    if not isinstance(header, dict):
        raise _bad("header is not a JSON object", file)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _bad("__metadata__ must map strings to strings", file)
    base = 8 + n
    infos = {name: _entry(name, e, base, file) for name, e in header.items()}
    _check_tiling(infos, base, size, file)
    return infos


def _entry(name: str, e, base: int, file: str) -> TensorInfo:
    if not isinstance(e, dict) or set(e) - {"dtype", "shape", "data_offsets"}:
        raise _bad(f"entry {name!r} is not {{dtype, shape, data_offsets}}", file)
    dtype, shape, offsets = e.get("dtype"), e.get("shape"), e.get("data_offsets")
    if dtype not in ITEM_SIZE:
        raise _bad(f"tensor {name!r} has unknown dtype {dtype!r}", file)
    if not isinstance(shape, list) or not all(_nonneg_int(d) for d in shape):
        raise _bad(f"tensor {name!r} has shape {shape!r}, not a list of non-negative ints", file)
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_nonneg_int, offsets))
            and offsets[0] <= offsets[1]):
        raise _bad(f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end]", file)
    nbytes = math.prod(shape) * ITEM_SIZE[dtype]
    if offsets[1] - offsets[0] != nbytes:
        raise _bad(f"tensor {name!r} claims {offsets[1] - offsets[0]} bytes, but {dtype} "
                   f"{shape} needs {nbytes}", file)
    return TensorInfo(dtype, tuple(shape), base + offsets[0], base + offsets[1])


def _nonneg_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _check_tiling(infos: dict[str, TensorInfo], base: int, size: int, file: str) -> None:
    at = base
    for name, info in sorted(infos.items(), key=lambda kv: (kv[1].start, kv[1].end)):
        if info.start != at:
            raise _bad(f"tensor {name!r} starts at data offset {info.start - base}, expected "
                       f"{at - base} (gap or overlap)", file)
        at = info.end
    if at != size:
        raise _bad(f"data is {size - base} bytes but the tensors cover {at - base}", file)


def is_float(info: TensorInfo) -> bool:
    return info.dtype in _FLOATS


def check_factor(key: str, info: TensorInfo, want: tuple[int, ...], what: str,
                 file: str) -> None:
    """AdapterError unless the tensor `key` has the shape `want` and a floating dtype;
    `what` says where the expected shape comes from (rank, base module)."""
    if info.shape != want:
        raise AdapterError(f"tensor {key!r} has shape {list(info.shape)}, expected "
                           f"{list(want)} ({what})", feature="shape", file=file)
    if not is_float(info):
        raise AdapterError(f"tensor {key!r} has dtype {info.dtype}, expected a floating type",
                           feature="dtype", file=file)
