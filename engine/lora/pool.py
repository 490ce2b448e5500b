"""The device slot pool: fixed, preallocated LoRA weight buffers for `max_loras` adapters.

Per (layer, group), in the layout kernels/lora/reference.py documents:

    a:     [max_loras, S, max_lora_rank, K]
    b:     [max_loras, N, max_lora_rank]      scaling folded in
    ranks: [max_loras] int32                  largest slice rank of the slot's adapter, 0 = empty

beside them, allocated at the first adapter that needs them: DoRA's per-row factors
(engine/lora/dora.py DoraFactors, computed on the pool's device at load from the slot's
own copy of A and B and the base weight) and LoRA on the ends, lm_head and embed_tokens
(engine/lora/end_slots.py);

and, for a mixture-of-experts model, per (layer, fused expert parameter) (the
architecture's expert_targets): a [max_loras, E, max_lora_rank, K],
b [max_loras, E, N, max_lora_rank] (this rank's K and N), allocated with the pool.

Each group's a (and b) of every layer are views of one tensor stacked over the layers,
[L, max_loras, S, max_lora_rank, K]: a slot of one group across all layers is one
strided view, and an adapter's host copy holds each group stacked the same way, one
group after the other in one buffer (engine/lora/weights.py). A load on CUDA is then one
copy of that buffer into a device staging buffer plus one strided device copy per group
and factor (about ten copies in all, whatever the number of layers); on the CPU, one
strided copy per group and factor.

The buffers are allocated once and never reallocated or resized: captured CUDA graphs
hold their addresses. After a load, every element of the slot holds the new adapter's
value or zero, so nothing of a previous occupant can leak into the next; the pool
remembers, per slot and group, how many rank columns may be nonzero and zeroes only
those the new adapter does not cover. The pool does not know which adapter is in which
slot; the engine's residency manager does, and it never loads or clears a slot a running
batch may read. It counts, per slot, the loads and clears (`generation`), so a copy of a
slot's weights made elsewhere (engine/lora/fused.py) can tell that it is stale.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from loramux_engine.lora.dora import DoraFactors
from loramux_engine.lora.end_slots import EndSlots
from loramux_engine.lora.weights import GroupWeights, LoRAWeights
from loramux_core.model.archs import architecture
from loramux_core.model.lora_targets import (expert_roles, expert_shard_shape, full_shape,
                                             groups, lora_group_shapes, row_parallel_groups)
from loramux_core.errors import AdapterError


class LoRAExtras(NamedTuple):
    """What a step needs beyond the decoder groups' LoRA: DoRA's row factors, lm_head
    LoRA, embed_tokens LoRA. Known on the host (`LoRASlotPool.extras_of` the step's
    slots), so a step without them launches nothing for them, and a CUDA graph is
    captured per combination."""
    dora: bool = False
    head: bool = False
    embed: bool = False


class LoRASlotPool:
    """Stacked LoRA buffers for every (layer, group) of one tensor-parallel rank."""

    def __init__(self, model_cfg, max_loras: int, max_lora_rank: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 tp_size: int = 1,
                 base_weight: Callable[[int, str], torch.Tensor] | None = None,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """`base_weight(layer, group)`: this rank's merged base weight [N, K] of a group
        (the model's `lora_base_weight`), needed by DoRA adapters only; `all_reduce`: the
        tensor-parallel sum (DoRA on row-parallel groups at TP > 1: `settle_dora`)."""
        assert max_loras >= 1 and max_lora_rank >= 1, (max_loras, max_lora_rank)
        self._base_weight = base_weight
        self._all_reduce = all_reduce
        self._ends = EndSlots(max_loras, max_lora_rank, dtype, torch.device(device))
        self._model_cfg = model_cfg
        self.expert_slots: set[int] = set()
        self._experts = _expert_buffers(model_cfg, max_loras, max_lora_rank, dtype,
                                        torch.device(device), tp_size)
        # (gate|up, down) fused expert parameters, as the architecture declares them
        self.expert_params = expert_roles(model_cfg) if self._experts else (None, None)
        self.num_layers = model_cfg.num_layers
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.dtype = dtype
        self.device = torch.device(device)
        self.tp_size = tp_size
        self.groups = groups(model_cfg)   # as the architecture declares them
        self._row_parallel = row_parallel_groups(model_cfg)
        self.shapes = lora_group_shapes(model_cfg, tp_size)
        self._offsets = {g: _offsets(s.out_features) for g, s in self.shapes.items()}
        self._a, self._b, self._ranks = {}, {}, {}
        keys = [(layer, group) for layer in range(self.num_layers) for group in self.groups]
        # one tensor for every ranks vector: a load writes a slot's column at once
        self._all_ranks = torch.zeros(len(keys), max_loras, dtype=torch.int32, device=self.device)
        self._key_index = {key: i for i, key in enumerate(keys)}
        # per slot: rank columns of each group that may be nonzero in some layer (0 = none)
        self._dirty = [dict.fromkeys(self.groups, 0) for _ in range(max_loras)]
        self._generation = [0] * max_loras   # per slot: loads and clears so far
        self._stack_a, self._stack_b = {}, {}  # group -> [L, max_loras, ...] (docstring)
        for group in self.groups:
            shape = self.shapes[group]
            self._stack_a[group] = torch.zeros(
                self.num_layers, max_loras, len(shape.out_features), max_lora_rank,
                shape.in_features, dtype=dtype, device=self.device)
            self._stack_b[group] = torch.zeros(
                self.num_layers, max_loras, sum(shape.out_features), max_lora_rank,
                dtype=dtype, device=self.device)
        for key in keys:
            self._a[key] = self._stack_a[key[1]][key[0]]
            self._b[key] = self._stack_b[key[1]][key[0]]
            self._ranks[key] = self._all_ranks[self._key_index[key]]
        self._dora = DoraFactors(max_loras, {key: b.shape[1] for key, b in self._b.items()},
                                 self.device, tp_size, self._row_parallel, all_reduce)
        # CUDA: an adapter's host copy, on the device (allocated with the pool, so memory
        # sizing sees it; grown only for a host copy larger than one slot, e.g. DoRA's)
        self._staging = (torch.empty(self._slot_bytes(), dtype=torch.uint8, device=self.device)
                         if self.device.type == "cuda" else None)
        self._staging_free = None                   # event: its last reader completed
        self.num_copies = 0                          # copies and fills queued by loads

    def weights(self, layer: int, group: str):
        """(a, b, ranks, slice_offsets) of one (layer, group), for loramux_kernels.lora.add_lora."""
        key = (layer, group)
        return self._a[key], self._b[key], self._ranks[key], self._offsets[group]

    def generation(self, slot: int) -> int:
        """A number that changes whenever `slot` is loaded, cleared or marked dirty: equal
        numbers at two times mean the slot's weights did not change between them."""
        return self._generation[slot]

    @property
    def nbytes(self) -> int:
        return (sum(t.nbytes for d in (self._stack_a, self._stack_b) for t in d.values())
                + self._all_ranks.nbytes
                + self._ends.nbytes
                + sum(t.nbytes for ab in self._experts.values() for t in ab))

    def load(self, slot: int, weights: LoRAWeights, stream: torch.cuda.Stream | None = None) -> None:
        """Copy an adapter into `slot`, replacing all of the slot's previous contents.

        Raises AdapterError (pool untouched) when the adapter's rank exceeds the pool's
        max_lora_rank; the copies are non-blocking from pinned host memory on CUDA, on
        `stream` when given (the caller orders the batch that first reads the slot after it)."""
        self._check_slot(slot)
        if weights.max_rank > self.max_lora_rank:
            raise AdapterError(f"adapter rank {weights.max_rank} exceeds max_lora_rank="
                               f"{self.max_lora_rank}", feature="rank", file=weights.source)
        assert (weights.num_layers, weights.tp_size, dict(weights.shapes)) == \
            (self.num_layers, self.tp_size, self.shapes), "adapter built for another model/TP layout"
        if weights.use_dora and (self._base_weight is None or self.tp_size > 1 and any(
                g.magnitude is not None and key[1] in self._row_parallel
                for key, g in weights.groups.items()) and self._all_reduce is None):
            raise AdapterError("use_dora=true: DoRA needs the base weights' rows, and on "
                               "row-parallel groups at tensor-parallel size > 1 the ranks' "
                               "all-reduce", feature="use_dora", file=weights.source)
        self._generation[slot] += 1
        with _on_stream(stream):
            non_blocking = self.device.type == "cuda" and weights.pinned
            if weights.stacked:
                self._copy_stacked(slot, weights, non_blocking)
            else:
                self._copy_groups(slot, weights.groups, non_blocking)
            ranks = [weights.rank_of(key) for key in self._a]
            self._write_ranks(slot, ranks)
            self._write_dora(slot, weights)
            self._ends.write(slot, weights.ends)
            self._write_experts(slot, weights.experts)
            if weights.buffer is not None and self.device.type == "cuda":
                # the host buffer is reused only after these copies have read it
                event = torch.cuda.Event()
                event.record()
                weights.buffer.fence(event)

    def reserve(self, weights: LoRAWeights) -> None:
        """Allocate now what `weights` will need beside the groups' buffers (DoRA's factor
        tables, an end target's buffers: made at the first adapter that needs them), so
        that a device without room refuses the adapter when it is read (AdapterError,
        feature "device_memory"), not a step when it is placed. Any thread."""
        needs = [("DoRA factors", self._dora.nbytes_to_allocate, self._dora.allocate)
                 ] if weights.use_dora else []
        needs += [(f"LoRA on {module}",
                   self._ends.nbytes_to_allocate(module, wa.shape[1], wb.shape[0]),
                   lambda m=module, k=wa.shape[1], n=wb.shape[0]: self._ends.allocate(m, k, n))
                  for module, (wa, wb) in weights.ends.items()]
        for what, nbytes, allocate in needs:
            try:
                allocate()
            except torch.OutOfMemoryError:
                raise AdapterError(
                    f"no device memory left for {what} ({nbytes / 2**20:.0f} MiB for "
                    f"{self.max_loras} slots); lower max_loras or gpu_memory_utilization",
                    feature="device_memory", file=weights.source) from None

    def allocate_extras(self, names) -> None:
        """Allocate now the buffers of the adapter features `names` ("dora", "lm_head",
        "embed_tokens": EngineConfig.lora_extras), which are otherwise made at the first
        adapter that needs them (`reserve`), so the start-up warm-up covers them."""
        if "dora" in names:
            self._dora.allocate()
        for module in ("lm_head", "embed_tokens"):
            if module in names:
                self._ends.allocate(module, *full_shape(self._model_cfg, module))  # unsharded

    def clear(self, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """Zero `slot` everywhere (its tokens would then add nothing)."""
        self._check_slot(slot)
        self._generation[slot] += 1
        with _on_stream(stream):
            for group in self.groups:
                self._zero_columns(slot, group, 0)
            self._write_ranks(slot, [0] * len(self._a))
            self._write_dora(slot, None)
            self._ends.write(slot, {})
            self._write_experts(slot, {})

    def mark_dirty(self, slot: int) -> None:
        """The slot's contents are unknown (written from outside): the next load or clear
        zeroes every column it does not write."""
        self._check_slot(slot)
        self._generation[slot] += 1
        self._dirty[slot] = dict.fromkeys(self.groups, self.max_lora_rank)

    def dora_scale(self, layer: int, group: str) -> torch.Tensor | None:
        """[max_loras + 1, N] float32 per-row factors of one (layer, group) (a token's
        slot indexes it, -1 for base: the last row); None while no DoRA adapter was ever
        loaded."""
        return self._dora.scale((layer, group))

    @property
    def dora_slots(self) -> set[int]:
        """Slots whose adapter is DoRA."""
        return self._dora.slots

    @property
    def end_slots(self) -> set[int]:
        """Slots whose adapter has LoRA on lm_head or embed_tokens."""
        return self._ends.all_slots

    def extras_of(self, slots: Iterable[int]) -> LoRAExtras:
        """What rows on `slots` (host ints, -1: base) need beyond the groups' LoRA."""
        slots = set(slots)
        return LoRAExtras(not slots.isdisjoint(self._dora.slots),
                          not slots.isdisjoint(self._ends.slots("lm_head")),
                          not slots.isdisjoint(self._ends.slots("embed_tokens")))

    @property
    def extras_allocated(self) -> LoRAExtras:
        """Every extra the pool has buffers for: what rows on any slot may need."""
        return LoRAExtras(self._dora.allocated, self._ends.weights("lm_head") is not None,
                          self._ends.weights("embed_tokens") is not None)

    @contextlib.contextmanager
    def extras_marked(self, slot: int):
        """Within: `slot` counts as holding every extra the pool has buffers for (as a
        DoRA adapter with LoRA on lm_head and embed_tokens would) in `extras_of`, whatever
        it holds; for the start-up warm-up's steps (engine/warmup.py). Only the host-side
        sets change, and they are as before on exit. Yields the extras marked."""
        self._check_slot(slot)
        sets = ([self._dora.slots] if self._dora.allocated else []) + [
            self._ends.slots(m) for m in ("lm_head", "embed_tokens")
            if self._ends.weights(m) is not None]
        added = [s for s in sets if slot not in s]
        for s in added:
            s.add(slot)
        try:
            yield self.extras_allocated
        finally:
            for s in added:
                s.discard(slot)

    def end_weights(self, module: str):
        """(a, b) of an end target for every slot (engine/lora/end_slots.py); None while
        no adapter with LoRA on it was ever loaded."""
        return self._ends.weights(module)

    def expert_weights(self, layer: int, param: str):
        """(a, b) of a fused expert parameter for every slot (module docstring), or
        (None, None) where the model has no such parameter."""
        return self._experts.get((layer, param), (None, None))

    def _write_experts(self, slot: int, experts) -> None:
        _clear_slot(slot, self._experts.values(), self.expert_slots)
        for key, (wa, wb) in experts.items():
            a, b = self._experts[key]
            r = wa.shape[1]
            a[slot, :, :r].copy_(wa)
            b[slot, :, :, :r].copy_(wb)
            self.expert_slots.add(slot)

    def settle_dora(self) -> None:
        """Finish the DoRA factors of row-parallel groups loaded at TP > 1 (one
        all-reduce; engine/lora/dora.py). Every rank calls it at the same point of the
        same step (a step that reads LoRA), whether anything is pending or not."""
        self._dora.settle()

    def _write_dora(self, slot: int, weights: LoRAWeights | None) -> None:
        """DoRA's per-row factors of the slot, from its device copy of A and B (written
        before) and the magnitudes."""
        if weights is None or not weights.use_dora:
            self._dora.clear(slot)
            return
        non_blocking = self.device.type == "cuda" and weights.pinned
        groups = {key: GroupWeights(self._a[key][slot], self._b[key][slot], gw.slice_ranks,
                                    gw.magnitude.to(self.device, non_blocking=non_blocking))
                  for key, gw in weights.groups.items() if gw.magnitude is not None}
        self._dora.write(slot, groups, self._base_weight, self.shapes)

    def _write_ranks(self, slot: int, ranks: list[int]) -> None:
        pin = self.device.type == "cuda"
        host = torch.tensor(ranks, dtype=torch.int32, pin_memory=pin)
        self._all_ranks[:, slot].copy_(host, non_blocking=pin)
        self.num_copies += 1

    def _copy_stacked(self, slot: int, weights: LoRAWeights, non_blocking: bool) -> None:
        """Write every group of the slot from the stacked host tensors: on CUDA one copy
        of the host buffer to the staging buffer, then one strided copy per factor."""
        sources = dict(weights.stacked)
        if self.device.type == "cuda":
            sources = self._staged(weights, non_blocking)
        for group in self.groups:
            src = sources.get(group)
            r = src[0].shape[2] if src is not None else 0
            self._zero_columns(slot, group, r)
            if src is not None:
                self._stack_a[group][:, slot, :, :r].copy_(src[0], non_blocking=non_blocking)
                self._stack_b[group][:, slot, :, :r].copy_(src[1], non_blocking=non_blocking)
                self._dirty[slot][group] = r
                self.num_copies += 2
        if self.device.type == "cuda":
            self._staging_free = torch.cuda.Event()
            self._staging_free.record()

    def _staged(self, weights: LoRAWeights, non_blocking: bool) -> dict:
        """The stacked tensors of `weights`, copied to the device in one copy: views of
        the staging buffer at the same offsets as in the host buffer."""
        nbytes = weights.buffer_bytes
        if self._staging_free is not None:  # the previous load's copies read it
            torch.cuda.current_stream(self.device).wait_event(self._staging_free)
        if self._staging.numel() < nbytes:
            # the old buffer goes back to the allocator only after this stream's work
            self._staging.record_stream(torch.cuda.current_stream(self.device))
            self._staging = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self._staging[:nbytes].copy_(weights.buffer.data[:nbytes], non_blocking=non_blocking)
        self.num_copies += 1
        base = weights.buffer.data.data_ptr()
        return {group: tuple(self._staging[t.data_ptr() - base:][:t.nbytes].view(t.dtype)
                             .view(t.shape) for t in ab)
                for group, ab in weights.stacked.items()}

    def _slot_bytes(self) -> int:
        """Bytes of one slot's stacked tensors, laid out as a host copy at max_lora_rank
        (engine/lora/weights.py: 256-byte aligned)."""
        size = 0
        for group in self.groups:
            for t in (self._stack_a[group][:, 0], self._stack_b[group][:, 0]):
                size += -(-t.numel() * t.element_size() // 256) * 256
        return size

    def _zero_columns(self, slot: int, group: str, r: int) -> None:
        """Zero the slot's rank columns r.. of `group` that may be nonzero."""
        dirty = self._dirty[slot][group]
        if dirty > r:
            self._stack_a[group][:, slot, :, r:dirty].zero_()
            self._stack_b[group][:, slot, :, r:dirty].zero_()
            self.num_copies += 2
        self._dirty[slot][group] = min(dirty, r)

    def _copy_groups(self, slot: int, groups, non_blocking: bool) -> None:
        """Write every (layer, group) of the slot from weights without stacked tensors
        (e.g. a pin_memory() copy): two copies per (layer, group)."""
        for group in self.groups:
            dirty, wrote = self._dirty[slot][group], 0
            for layer in range(self.num_layers):
                a, b = self._a[(layer, group)][slot], self._b[(layer, group)][slot]
                gw = groups.get((layer, group))
                r = gw.a.shape[1] if gw is not None else 0
                if dirty > r:  # columns of a larger previous adapter
                    a[:, r:dirty].zero_()
                    b[:, r:dirty].zero_()
                if gw is not None:
                    a[:, :r].copy_(gw.a, non_blocking=non_blocking)
                    b[:, :r].copy_(gw.b, non_blocking=non_blocking)
                    self.num_copies += 2
                wrote = max(wrote, r)
            self._dirty[slot][group] = wrote

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise IndexError(f"slot {slot} out of range [0, {self.max_loras})")


def _clear_slot(slot: int, buffers, used: set[int]) -> None:
    """Zero `slot` of every (a, b) in `buffers` if it holds anything (`used`)."""
    if slot in used:
        for a, b in buffers:
            a[slot].zero_()
            b[slot].zero_()
        used.discard(slot)


def _expert_buffers(model_cfg, max_loras: int, rank: int, dtype, device, tp_size: int) -> dict:
    """{(layer, param): (a, b)} zeroed, for every fused expert parameter of the model."""
    out = {}
    if getattr(model_cfg, "moe", None) is None:
        return out
    E = model_cfg.moe.num_experts
    for t in architecture(model_cfg).expert_targets:
        k, n = expert_shard_shape(model_cfg, t.param, tp_size)
        for layer in range(model_cfg.num_layers):
            out[(layer, t.param)] = (
                torch.zeros(max_loras, E, rank, k, dtype=dtype, device=device),
                torch.zeros(max_loras, E, n, rank, dtype=dtype, device=device))
    return out


def _offsets(widths: tuple[int, ...]) -> tuple[int, ...]:
    out = [0]
    for w in widths:
        out.append(out[-1] + w)
    return tuple(out)


def _on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
