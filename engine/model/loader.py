"""Read base-model weights from the safetensors files of a Hugging Face model directory.

One file (`model.safetensors`) or many (`model-0000i-of-0000n.safetensors` with
`model.safetensors.index.json`). Tensors are read one at a time through
`safe_open(...).get_slice(...)`, so a tensor-parallel rank reads only its own rows or
columns and never materialises a full tensor it does not need. Pickle checkpoints
(*.bin, *.pt, *.pth) are refused: loading them can execute arbitrary code.

FP8 checkpoints (config.json `quantization_config.quant_method: "fp8"`) store a linear
weight as float8_e4m3fn next to a float32 `{module}.weight_scale`: one value for the
tensor ([] or [1]) or one per output row ([out] or [out, 1]); W = W_fp8 · scale.
`read` returns such a weight dequantized (the CPU reference path), `read_fp8` the raw
FP8 rows with their per-row scales (the FP8 GEMM on the GPU). Scale tensors (and static
activation scales, `input_scale`, which the dynamic per-token path does not use) are not
listed by `names`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from loramux_core.model.sharding import Shard
from loramux_core.errors import ModelLoadError

INDEX_FILE = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class WeightSource:
    """The tensors of one model directory: names, shapes, and sliced reads.

    Use as a context manager (`with WeightSource.open(dir) as src:`) so file handles
    are released after loading."""

    def __init__(self, model_dir: Path, file_of: dict[str, str]):
        self.model_dir = model_dir
        self._file_of = file_of
        self._handles: dict[str, object] = {}

    @classmethod
    def open(cls, model_dir: str | Path) -> "WeightSource":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise ModelLoadError(f"model directory {model_dir} does not exist")
        index = model_dir / INDEX_FILE
        if index.is_file():
            return cls(model_dir, _read_index(index))
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
        if not files:
            _refuse_without_safetensors(model_dir)
        return cls(model_dir, _scan_files(model_dir, files))

    def __enter__(self) -> "WeightSource":
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()

    def names(self) -> set[str]:
        """Every tensor but the FP8 scales (module docstring)."""
        return {n for n in self._file_of if not _is_scale(n, self._file_of)}

    def is_fp8(self, name: str) -> bool:
        return self._slice(name).get_dtype().startswith("F8")

    def file_of(self, name: str) -> str:
        return self._file_of[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, rows: Shard | None = None, cols: Shard | None = None,
             dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name`, restricted to `rows` (dim 0) and/or `cols` (dim 1), in `dtype`."""
        if self.is_fp8(name):
            raw, scale = self.read_fp8(name, rows, cols)
            t = raw.float() * scale.unsqueeze(1)
            return t.to(dtype) if dtype is not None else t
        t = self._read(name, rows, cols)
        return t.to(dtype) if dtype is not None else t

    def read_fp8(self, name: str, rows: Shard | None = None,
                 cols: Shard | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(float8_e4m3fn rows of FP8 weight `name`, restricted like `read`; float32 scale
        per returned row)."""
        dtype = self._slice(name).get_dtype()
        if dtype != "F8_E4M3":
            raise ModelLoadError(f"tensor {name!r} in {self.file_of(name)} has dtype {dtype}; "
                                 f"FP8 weights are served as float8_e4m3fn only")
        scale_name = name.removesuffix("weight") + "weight_scale"
        if scale_name not in self._file_of:
            raise ModelLoadError(f"FP8 tensor {name!r} in {self.file_of(name)} has no "
                                 f"{scale_name!r} beside it")
        out_rows = self.shape(name)[0]
        shape = self.shape(scale_name)
        if shape in ((), (1,)):
            scale = self._read(scale_name, None, None).float().reshape(1)
        elif shape in ((out_rows,), (out_rows, 1)):
            scale = self._read(scale_name, rows, None).float().reshape(-1)
        else:
            raise ModelLoadError(f"tensor {scale_name!r} in {self.file_of(scale_name)} has "
                                 f"shape {list(shape)}: FP8 scales are per tensor ([] or [1]) "
                                 f"or per output channel ([{out_rows}] or [{out_rows}, 1])")
        raw = self._read(name, rows, cols)
        return raw, scale.expand(raw.shape[0]).contiguous()

    def _read(self, name: str, rows: Shard | None, cols: Shard | None) -> torch.Tensor:
        sl = self._slice(name)
        if not sl.get_shape():   # a scalar (a per-tensor scale)
            return sl[()]
        r = slice(rows.start, rows.stop) if rows is not None else slice(None)
        if cols is not None:
            return sl[r, cols.start:cols.stop]
        return sl[r]

    def _slice(self, name: str):
        file = self._file_of[name]
        handle = self._handles.get(file)
        if handle is None:
            try:
                handle = safe_open(str(self.model_dir / file), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise ModelLoadError(f"{file}: not a readable safetensors file: {e}") from e
            self._handles[file] = handle
        return handle.get_slice(name)


def _is_scale(name: str, names) -> bool:
    """An FP8 scale: `{module}.weight_scale` or `{module}.input_scale` beside a weight."""
    for suffix in ("weight_scale", "input_scale"):
        if name.endswith("." + suffix) and name.removesuffix(suffix) + "weight" in names:
            return True
    return False


def _read_index(index: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{index.name}: malformed (needs a 'weight_map' object): {e}") from e
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index.name}: 'weight_map' must be a non-empty object")
    for file in sorted(set(weight_map.values())):
        if not (index.parent / file).is_file():
            raise ModelLoadError(f"{index.name}: lists {file!r}, which is not in the model directory")
    return dict(weight_map)


def _scan_files(model_dir: Path, files: list[str]) -> dict[str, str]:
    file_of: dict[str, str] = {}
    for file in files:
        try:
            with safe_open(str(model_dir / file), framework="pt", device="cpu") as f:
                names = list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise ModelLoadError(f"{file}: not a readable safetensors file: {e}") from e
        for name in names:
            if name in file_of:
                raise ModelLoadError(f"tensor {name!r} is in both {file_of[name]} and {file}")
            file_of[name] = file
    return file_of


def _refuse_without_safetensors(model_dir: Path) -> None:
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise ModelLoadError(
            f"model directory {model_dir.name} has only pickle checkpoints ({', '.join(pickles)}); "
            f"pickle is never loaded: convert the weights to safetensors")
    raise ModelLoadError(f"model directory {model_dir.name} has no *.safetensors weight files")
