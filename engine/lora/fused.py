"""One adapter inside the base GEMMs: the LoRA of a step whose rows all use one slot.

The model's o_proj and down_proj keep `max_lora_rank` spare rows below their weights,
[W; A] (engine/model/layers.py RowParallelLinear `lora_rows`). With the adapter of the
step copied there, one GEMM gives the base output and the adapter's shrink side by side:

    x @ [W; A]ᵀ = [ x·Wᵀ | s ],  s = x·Aᵀ  [T, max_lora_rank]

and the expand adds s·Bᵀ into the base columns (kernels.lora.expand_rows): the group
has no shrink launch of its own. The rows hold one adapter at a time: `install(slot)`
copies the slot's A of every layer there when the rows hold anything else, judged by
the slot and the pool's generation of it (a slot loaded again, with the same or another
adapter, is copied again). It runs before the step, on the step's stream, never inside a
captured graph: a graph captured over the rows reads whatever they hold at its replay.

Which steps take it is engine/lora/batch.py's choice (FUSED_LORA_GEMM); the model has
the rows only where it can be used (`fused_lora_rank`, engine/model/build.py): one
tensor-parallel rank, no FP8, no experts, CUDA.
"""
from __future__ import annotations

import torch

from engine.lora.pool import LoRASlotPool
from kernels.lora import TOKEN_PATH_MAX_TOKENS

# the groups whose shrink rides as extra output rows of the base weight
ROW_GROUPS = ("o", "down")


class FusedAdapter:
    """The spare rows of a model's base weights and the adapter they hold."""

    def __init__(self, pool: LoRASlotPool, targets: dict[tuple[int, str], torch.Tensor]):
        """`targets`: {(layer, group): [W; A] storage} (the model's `fused_lora_weights`),
        each with pool.max_lora_rank spare rows."""
        self.pool = pool
        self.targets = dict(targets)
        self._rows = []                   # (layer, group, its spare rows) of every target
        for (layer, group), storage in self.targets.items():
            assert group in ROW_GROUPS, group
            out = storage.shape[0] - pool.max_lora_rank
            assert out == pool.shapes[group].out_features[0], (group, storage.shape)
            self._rows.append((layer, group, storage[out:]))
        self.installed: tuple[int, int] | None = None   # (slot, generation) the rows hold
        self.num_installs = 0

    def install(self, slot: int) -> None:
        """Make the spare rows hold `slot`'s adapter as the pool holds it now: A of every
        layer copied (one batched copy), unless they already do. On the current stream,
        outside any graph capture."""
        want = (slot, self.pool.generation(slot))
        if self.installed == want:
            return
        dst = [rows for _, _, rows in self._rows]
        src = [self.pool.weights(layer, group)[0][slot, 0] for layer, group, _ in self._rows]
        torch._foreach_copy_(dst, src)
        self.installed = want
        self.num_installs += 1

    @staticmethod
    def fits(num_tokens: int) -> bool:
        """Whether a step of `num_tokens` rows may take the fused path: the token-sized
        expand's sizes (kernels/lora/token.py)."""
        return 0 < num_tokens <= TOKEN_PATH_MAX_TOKENS

    def weight(self, layer: int, group: str) -> torch.Tensor | None:
        """[W; A] of (layer, group), or None where the group has no spare rows."""
        return self.targets.get((layer, group))

    @property
    def nbytes(self) -> int:
        """Bytes of the spare rows (what they add to the model's weights)."""
        return sum(rows.nbytes for _, _, rows in self._rows)
