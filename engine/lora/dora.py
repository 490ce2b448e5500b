"""DoRA's per-row factors for the slot pool (PEFT's DoraLinearLayer): the wrapped layer's
output, base plus LoRA term and before the bias, is multiplied per output row by
m / ||W + B·A·scaling||, the norm over the row's whole input width.

A column-parallel group holds whole rows on each rank, so its factors are computed at
load. A row-parallel group (o, down) holds only this rank's columns of every row: the
load keeps each row's partial sum of squares, and `PendingNorms.settle` adds them across
the ranks with one all-reduce, inside the first step that reads LoRA after the load. Every
rank loads the same adapters into the same slots before that step and runs that step,
so they all join that all-reduce. `DoraFactors` holds the factors of every slot for the
pool (engine/lora/pool.py); the kernels apply them per row by slot (loramux_kernels.lora
scale_rows).
"""
from __future__ import annotations

import threading
from collections.abc import Callable

import torch


def _slices(gw, shape):
    """(slice index, rank, rows) of each wrapped slice of a group."""
    offset = 0
    for s, width in enumerate(shape.out_features):
        if gw.slice_ranks[s]:
            yield s, gw.slice_ranks[s], slice(offset, offset + width)
        offset += width


CHUNK_ROWS = 2048   # rows of W + B·A held at once in float32 (a bounded temporary on a
                    # GPU whose memory the KV cache fills: 64 MB at an input width of 8K)


def _sq_norms(gw, base: torch.Tensor, s: int, r: int, rows: slice) -> torch.Tensor:
    """Sum of squares of each row of (W + B·A)[rows] (this rank's columns), in float32,
    CHUNK_ROWS rows at a time."""
    parts = []
    for lo in range(rows.start, rows.stop, CHUNK_ROWS):
        part = slice(lo, min(lo + CHUNK_ROWS, rows.stop))
        full = base[part].float() + gw.b[part, :r].float() @ gw.a[s, :r].float()
        parts.append(full.square().sum(dim=1))
    return torch.cat(parts)


def write_factors(out: torch.Tensor, gw, base: torch.Tensor, shape) -> None:
    """out[rows of each wrapped slice] = magnitude / row norm of (W + B·A), in float32
    (whole rows: a column-parallel group, or any group at TP = 1)."""
    for s, r, rows in _slices(gw, shape):
        norm = _sq_norms(gw, base, s, r, rows).sqrt()
        out[rows] = (gw.magnitude[rows].float() / norm).to(out.dtype)


class PendingNorms:
    """Partial squared row norms of row-parallel groups, per slot, until `settle`.

    On CUDA a load computes them on its own stream (rank 0's slot copies run on the
    copier's side stream, engine/adapters/copier.py) and `settle` reads them on the stream
    of a later step, which is ordered after the copies of the adapters it runs only: not
    after this load, whose adapter runs at the earliest in the step after. So `add` records
    an event after the load's work and `settle` makes its stream wait for it."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self._device = device
        self._parts: dict[int, list] = {}   # slot -> [(key, rows, sum of squares, m)]
        self._made: dict[int, object] = {}  # slot -> event after its load's work (CUDA)

    def __bool__(self) -> bool:
        return bool(self._parts)

    def add(self, slot: int, key, gw, base: torch.Tensor, shape) -> None:
        for s, r, rows in _slices(gw, shape):
            sq = _sq_norms(gw, base, s, r, rows)
            self._parts.setdefault(slot, []).append((key, rows, sq, gw.magnitude[rows]))
        if self._device.type == "cuda":   # also after the magnitude's copy, queued before
            self._made[slot] = torch.cuda.Event()
            self._made[slot].record(torch.cuda.current_stream(self._device))

    def drop(self, slot: int) -> None:
        self._parts.pop(slot, None)
        self._made.pop(slot, None)

    def settle(self, all_reduce: Callable[[torch.Tensor], torch.Tensor], scales: dict) -> None:
        """Sum every pending partial across the ranks (one all-reduce) and write the
        factors into `scales[key][slot]`, on the current stream, after the loads' work."""
        if self._made:
            stream = torch.cuda.current_stream(self._device)
            for event in self._made.values():
                stream.wait_event(event)
            self._made.clear()
        order = [(slot, part) for slot in sorted(self._parts) for part in self._parts[slot]]
        total = all_reduce(torch.cat([sq for _, (_, _, sq, _) in order]))
        at = 0
        for slot, (key, rows, sq, m) in order:
            if sq.is_cuda:  # made on a load's stream, read on this one: not reused before
                sq.record_stream(torch.cuda.current_stream(sq.device))
                m.record_stream(torch.cuda.current_stream(m.device))
            n = sq.numel()
            norm = total[at:at + n].sqrt()
            scales[key][slot, rows] = (m.float() / norm).to(scales[key].dtype)
            at += n
        self._parts.clear()


def wait_filled(device: torch.device) -> None:
    """Wait for the fill of new buffers: made on whichever thread's stream allocated
    them (a reader's), they are written next on other streams (a slot load's). Also
    used by engine/lora/end_slots.py."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class DoraFactors:
    """The pool's DoRA factors: (layer, group) -> [max_loras + 1, N] float32, m / ||W + B·A||
    per output row of a DoRA slot's wrapped slices and 1 elsewhere; the last row (tokens
    of the base model, slot -1) is all ones. Allocated at the first DoRA load and never
    moved afterwards (CUDA graphs hold the addresses); `slots` says on the host which
    slots hold a DoRA adapter."""

    def __init__(self, max_loras: int, widths: dict, device: torch.device, tp_size: int,
                 row_parallel: frozenset | set,
                 all_reduce: Callable[[torch.Tensor], torch.Tensor] | None):
        """`widths[(layer, group)]`: the group's N on this rank; `row_parallel`: groups whose
        rows are cut by columns across the ranks (their norms wait for `settle`)."""
        self._max_loras, self._widths, self._device = max_loras, widths, device
        self._split = row_parallel if tp_size > 1 else frozenset()
        self._all_reduce = all_reduce
        self._scale: dict = {}
        self._pending = PendingNorms(device)
        self._lock = threading.Lock()      # `allocate` may run on an adapter reader thread
        self.slots: set[int] = set()

    @property
    def allocated(self) -> bool:
        return bool(self._scale)

    @property
    def nbytes_to_allocate(self) -> int:
        return 0 if self._scale else 4 * (self._max_loras + 1) * sum(self._widths.values())

    def allocate(self) -> None:
        """The factor tables, all ones, if not there yet (once: addresses never change)."""
        with self._lock:
            if not self._scale:
                scale = {key: torch.ones(self._max_loras + 1, n, dtype=torch.float32,
                                         device=self._device)
                         for key, n in self._widths.items()}
                wait_filled(self._device)
                self._scale = scale

    def scale(self, key) -> torch.Tensor | None:
        return self._scale.get(key)

    def clear(self, slot: int) -> None:
        """Factor 1 for every row of `slot` (a slot without a DoRA adapter)."""
        self._pending.drop(slot)
        if slot in self.slots:
            for scale in self._scale.values():
                scale[slot].fill_(1.0)
            self.slots.discard(slot)

    def write(self, slot: int, groups: dict, base_weight: Callable, shapes: dict) -> None:
        """The factors of `slot` from its adapter's `groups[(layer, group)]` (GroupWeights
        on this device: the slot's A and B, the magnitude); row-parallel groups at TP > 1
        wait for `settle`."""
        self._pending.drop(slot)
        self.allocate()
        for key, scale in self._scale.items():
            scale[slot].fill_(1.0)
            gw = groups.get(key)
            if gw is None:
                continue
            if key[1] in self._split:
                self._pending.add(slot, key, gw, base_weight(*key), shapes[key[1]])
            else:
                write_factors(scale[slot], gw, base_weight(*key), shapes[key[1]])
        self.slots.add(slot)

    def settle(self) -> None:
        """Sum the pending row-parallel norms across the ranks (one all-reduce). Every rank
        calls it at the same point of the same step (a step that reads LoRA), whether
        anything is pending or not."""
        if self._pending:
            self._pending.settle(self._all_reduce, self._scale)
