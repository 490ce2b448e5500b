"""Rank 0's side of adapter residency at TP > 1: every lifecycle change reaches all ranks.

- Host copies: `ShardedAdapterLoader.load(path)` is the registry's weight loader. Rank 0
  reads and validates its own shard first (bad adapters fail here, before any worker is
  bothered); then every worker reads its shard of the same files (load_lora(tp=...)),
  under a handle. When rank 0's copy is dropped (unload, replacement, host eviction) the
  workers are told to drop theirs too.
- Slots: `BroadcastingSlotPool` is the pool the engine's residency code drives; each
  load/clear applies to rank 0's pool at once and is queued for the workers, who apply it
  from the next step plan, before that step's forward pass (the step that first reads it).
Pinning and LRU decisions are rank 0's alone; workers just follow the resulting slot ops.
"""
from __future__ import annotations

import itertools
import weakref

from engine.distributed.plan import HOST_DROP, SLOT_CLEAR, SLOT_LOAD
from engine.errors import AdapterError
from engine.lora import LoRASlotPool, load_lora


class ShardedAdapterLoader:
    def __init__(self, executor, model_cfg, max_lora_rank: int, dtype):
        self._exec = executor
        self._cfg, self._max_rank, self._dtype = model_cfg, max_lora_rank, dtype
        self._handles: dict[int, int] = {}   # id(rank 0's LoRAWeights) -> handle
        self._next = itertools.count(1)

    def load(self, path: str):
        weights = load_lora(path, self._cfg, self._max_rank, tp=self._exec.tp,
                            dtype=self._dtype)
        handle = next(self._next)
        failures = self._exec.add_adapter(handle, str(path))
        if failures:
            self._exec.queue_op(HOST_DROP, -1, handle)
            raise AdapterError(f"{failures} tensor-parallel rank(s) could not read the "
                               "adapter that rank 0 read", feature="tp_load", file=str(path))
        key = id(weights)
        self._handles[key] = handle
        weakref.finalize(weights, self._dropped, key, handle)
        return weights

    def handle_of(self, weights) -> int:
        handle = self._handles.get(id(weights))
        assert handle is not None, "slot load of adapter weights not read by this loader"
        return handle

    def _dropped(self, key: int, handle: int) -> None:
        # runs when rank 0 lets go of its host copy: only queue, never communicate here
        self._handles.pop(key, None)
        self._exec.queue_op(HOST_DROP, -1, handle)


class BroadcastingSlotPool:
    """Rank 0's LoRASlotPool (everything else delegates to it) with load/clear mirrored."""

    def __init__(self, local: LoRASlotPool, loader: ShardedAdapterLoader, executor):
        self.local = local
        self._loader = loader
        self._exec = executor

    def load(self, slot: int, weights, stream=None) -> None:
        self.local.load(slot, weights, stream)
        self._exec.queue_op(SLOT_LOAD, slot, self._loader.handle_of(weights))

    def clear(self, slot: int, stream=None) -> None:
        self.local.clear(slot, stream)
        self._exec.queue_op(SLOT_CLEAR, slot, 0)

    def __getattr__(self, name):
        return getattr(self.local, name)
