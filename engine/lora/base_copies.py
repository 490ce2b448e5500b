"""The values check of an adapter's full copies of base layers (what PEFT's default
`save_embedding_layers="auto"` writes beside LoRA on embed_tokens and lm_head; the header
rules are loramux_core/adapter/base_copies.py).

A copy is accepted when it equals the base layer bit for bit in the copy's dtype: the base
checkpoint's tensor, cast to the copy's dtype as torch casts (round to nearest even), has
the copy's bytes. The base tensor comes from the checkpoint on disk, whole and unpadded
(not the engine's vocabulary-padded or tensor-parallel shards, which may also be FP8),
read once per process and dtype: its digest is kept, and each adapter's copy is hashed
and compared with it. Only a copy that differs is compared element by element, to say
where. The copy itself is never built into the served weights.
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import torch

from loramux_engine.lora.tensor_view import tensor
from loramux_engine.model.loader import WeightSource
from loramux_core.adapter.base_copies import base_weight_names
from loramux_core.adapter.plan import AdapterPlan
from loramux_core.errors import AdapterError, ModelLoadError
from loramux_core.model.sharding import Shard

_CHUNK_BYTES = 64 << 20     # rows of the base tensor cast at a time: memory stays bounded
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class BaseLayers:
    """The base checkpoint's end layers of one model directory, as digests per dtype.
    Thread-safe; one per process that reads adapters."""

    def __init__(self, model_dir: str | Path, tied: bool):
        self.model_dir, self.tied = Path(model_dir), tied
        self._digests: dict[tuple[str, torch.dtype], bytes] = {}
        self._lock = threading.Lock()

    def check(self, plan: AdapterPlan) -> None:
        """AdapterError naming the tensor unless every base-layer copy in `plan` equals
        the base model's layer (module docstring)."""
        for module, key in plan.base_copies:
            copy = tensor(plan.weights, plan.tensors[key])
            start, end = plan.tensors[key].start, plan.tensors[key].end
            name = self._base_name(module)
            got = hashlib.sha256(memoryview(plan.weights)[start:end]).digest()
            if got != self._digest(name, copy.dtype):
                n = self._count_differences(name, copy)
                raise AdapterError(
                    f"tensor {key!r} is a full copy of the base {module} that differs from "
                    f"the base model's {name} at {n} of {copy.numel()} elements (compared bit "
                    f"for bit in {str(copy.dtype).removeprefix('torch.')}); only an unchanged "
                    f"copy is served: save the adapter with save_embedding_layers=False",
                    feature="save_embedding_layers", file=plan.weights_file)

    def _base_name(self, module: str) -> str:
        with WeightSource.open(self.model_dir) as src:
            names = src.names()
        for name in base_weight_names(module, self.tied):
            if name in names:
                return name
        raise AdapterError(f"the base checkpoint holds no {module} weight to compare the "
                           f"adapter's copy with", feature="save_embedding_layers")

    def _digest(self, name: str, dtype: torch.dtype) -> bytes:
        with self._lock:  # one read per (tensor, dtype), whoever asks first
            if (name, dtype) not in self._digests:
                h = hashlib.sha256()
                for _, rows in self._base_rows(name, dtype):
                    h.update(memoryview(rows.contiguous().view(torch.uint8).numpy()))
                self._digests[(name, dtype)] = h.digest()
            return self._digests[(name, dtype)]

    def _count_differences(self, name: str, copy: torch.Tensor) -> int:
        bits = _BITS[copy.element_size()]
        differ = 0
        for start, rows in self._base_rows(name, copy.dtype):
            mine = copy[start:start + rows.shape[0]]
            differ += int((mine.view(bits) != rows.view(bits)).sum())
        return differ

    def _base_rows(self, name: str, dtype: torch.dtype):
        """(first row, rows of the base tensor cast to `dtype`), a few MB at a time."""
        try:
            with WeightSource.open(self.model_dir) as src:
                total, width = src.shape(name)
                step = max(1, _CHUNK_BYTES // max(1, width * 4))
                for start in range(0, total, step):
                    rows = src.read(name, rows=Shard(start, min(step, total - start)))
                    yield start, rows.to(dtype)
        except ModelLoadError as err:
            raise AdapterError(f"the base checkpoint's {name} cannot be read to compare the "
                               f"adapter's copy with: {err}",
                               feature="save_embedding_layers") from None
