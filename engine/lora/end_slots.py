"""LoRA on the model's ends (lm_head, embed_tokens: loramux_core/model/lora_targets.py
END_TARGETS) for every slot of the pool:

    a: [max_loras, max_lora_rank, K]    lora_A (embed_tokens: [R, vocab]; lm_head: [R, hidden])
    b: [max_loras, N, max_lora_rank]    lora_B * scaling (lm_head: N = vocab)

one pair per target, allocated at the first adapter with LoRA on it and never moved
afterwards (CUDA graphs hold the addresses); rows past an adapter's rank are zero. Which
slots hold each target is known on the host (`slots`), so a step without such rows
launches nothing for it.
"""
from __future__ import annotations

import threading

import torch

from loramux_engine.lora.dora import wait_filled


class EndSlots:
    def __init__(self, max_loras: int, max_lora_rank: int, dtype: torch.dtype,
                 device: torch.device):
        self._max_loras, self._rank, self._dtype, self._device = (max_loras, max_lora_rank,
                                                                  dtype, device)
        self._buffers: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._slots: dict[str, set[int]] = {}
        self._lock = threading.Lock()      # `allocate` may run on an adapter reader thread

    def weights(self, module: str):
        """(a, b) of `module` for every slot; None while no adapter had LoRA on it."""
        return self._buffers.get(module)

    def slots(self, module: str) -> set[int]:
        return self._slots.get(module, set())

    @property
    def all_slots(self) -> set[int]:
        return set().union(*self._slots.values())

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for ab in self._buffers.values() for t in ab)

    def nbytes_to_allocate(self, module: str, in_features: int, out_features: int) -> int:
        if module in self._buffers:
            return 0
        return (self._max_loras * self._rank * (in_features + out_features)
                * self._dtype.itemsize)

    def allocate(self, module: str, in_features: int, out_features: int) -> None:
        """Zeroed buffers of `module` (A of width `in_features`, B of `out_features` rows),
        if not there yet (once: addresses never change)."""
        with self._lock:
            if module not in self._buffers:
                ab = (torch.zeros(self._max_loras, self._rank, in_features, dtype=self._dtype,
                                  device=self._device),
                      torch.zeros(self._max_loras, out_features, self._rank, dtype=self._dtype,
                                  device=self._device))
                wait_filled(self._device)
                self._slots[module] = set()
                self._buffers[module] = ab

    def write(self, slot: int, ends) -> None:
        """Replace the slot's end LoRA with `ends` ({module: (A, B * scaling)}, host or
        device tensors; empty: none)."""
        for module, (a, b) in self._buffers.items():
            if slot in self._slots[module]:
                a[slot].zero_()
                b[slot].zero_()
                self._slots[module].discard(slot)
        for module, (wa, wb) in ends.items():
            self.allocate(module, wa.shape[1], wb.shape[0])
            a, b = self._buffers[module]
            a[slot, :wa.shape[0]].copy_(wa)
            b[slot, :, :wb.shape[1]].copy_(wb)
            self._slots[module].add(slot)
