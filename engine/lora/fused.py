"""One adapter inside the base GEMMs: the LoRA of a step whose rows all use one slot.

E = max_lora_rank. The model's o_proj and down_proj keep E spare rows below their
weights, [W; A] (engine/model/layers.py RowParallelLinear `lora_rows`). With the adapter
of the step copied there, one GEMM gives the base output and the adapter's shrink side
by side, and the expand adds s·Bᵀ into the base columns (loramux_kernels.lora.expand_rows):

    x @ [W; A]ᵀ = [ x·Wᵀ | s ],  s = x·Aᵀ  [T, E]

qkv_proj and gate_up_proj keep S·E spare columns beside theirs, [W | B] with B block-
diagonal (slice i's output rows read only the columns of slice i's s; zeros elsewhere),
and the add + RMSNorm before them writes its output and the finished shrink side by side
(loramux_kernels.lora.add_norm_shrink_cols), so one GEMM adds the delta:

    [x | s] @ [W | B]ᵀ = x·Wᵀ + s·Bᵀ

Neither group has a LoRA launch of its own then, and o's and down's expand is added by
the norm after them (engine/lora/batch.py `add_norm`): a layer has none. (Which of
these a step does is FUSED_LORA_GEMM's setting.) The spare rows and columns hold one
adapter at a time: `install(slot)` copies the slot's A (o, down) and B (qkv, gate_up) of
every layer there when they hold anything else, judged by the slot and the pool's
generation of it (a slot loaded again, with the same or another adapter, is copied
again). It runs before the step, on the step's stream, never inside a captured graph: a
graph captured over them reads whatever they hold at its replay.

Which steps take it is engine/lora/batch.py's choice (`fused_gemm`); the model has the
spare rows and columns only where they can be used (`fused_lora_rank`,
engine/model/build.py): one tensor-parallel rank, no FP8, no experts, CUDA.
"""
from __future__ import annotations

import torch

from loramux_engine.lora.pool import LoRASlotPool
from loramux_kernels.lora import TOKEN_PATH_MAX_TOKENS

# the groups whose shrink rides as extra output rows of the base weight
ROW_GROUPS = ("o", "down")
# the groups whose expand rides as extra input columns (their shrink is in the norm before)
COL_GROUPS = ("qkv", "gate_up")


class FusedAdapter:
    """The spare rows and columns of a model's base weights and the adapter they hold."""

    def __init__(self, pool: LoRASlotPool, targets: dict[tuple[int, str], torch.Tensor]):
        """`targets`: {(layer, group): storage} (the model's `fused_lora_weights`): [W; A]
        with pool.max_lora_rank spare rows (ROW_GROUPS), [W | B] with that many spare
        columns per slice (COL_GROUPS)."""
        self.pool = pool
        self.targets = dict(targets)
        E = pool.max_lora_rank
        self._rows = []      # (layer, group, slice, spare block) of every target
        self.nbytes = 0      # the spare rows and columns: what they add to the weights
        for (layer, group), storage in self.targets.items():
            shape = pool.shapes[group]
            if group in ROW_GROUPS:
                assert storage.shape == (shape.out_features[0] + E, shape.in_features), group
                self._rows.append((layer, group, None, storage[-E:]))
                self.nbytes += storage[-E:].nbytes
                continue
            assert group in COL_GROUPS, group
            K, offsets = shape.in_features, pool.weights(layer, group)[3]
            assert storage.shape == (offsets[-1], K + (len(offsets) - 1) * E), group
            for i, (lo, hi) in enumerate(zip(offsets, offsets[1:])):
                block = storage[lo:hi, K + i * E:K + (i + 1) * E]
                self._rows.append((layer, group, (lo, hi), block))
            # the columns past K of each row, the rows' padding included
            self.nbytes += storage.shape[0] * (storage.stride(0) - K) * storage.element_size()
        self.installed: tuple[int, int] | None = None   # (slot, generation) the rows hold
        self.num_installs = 0

    def install(self, slot: int) -> None:
        """Make the spare rows and columns hold `slot`'s adapter as the pool holds it now:
        A and B of every layer copied (one batched copy), unless they already do. On the
        current stream, outside any graph capture."""
        want = (slot, self.pool.generation(slot))
        if self.installed == want:
            return
        dst = [block for *_, block in self._rows]
        src = [self._source(slot, layer, group, rows) for layer, group, rows, _ in self._rows]
        torch._foreach_copy_(dst, src)
        self.installed = want
        self.num_installs += 1

    def _source(self, slot: int, layer: int, group: str, rows) -> torch.Tensor:
        """What a spare block holds for `slot`: A [E, K] (a row group), or B's rows of one
        slice [hi - lo, E] (a column group)."""
        a, b, _, _ = self.pool.weights(layer, group)
        return a[slot, 0] if rows is None else b[slot, rows[0]:rows[1]]

    def columns(self, layer: int, group: str) -> bool:
        """Whether (layer, group) keeps spare columns (its expand rides in its GEMM)."""
        return group in COL_GROUPS and (layer, group) in self.targets

    @staticmethod
    def fits(num_tokens: int) -> bool:
        """Whether a step of `num_tokens` rows may take the fused path: the token-sized
        expand's sizes (kernels/lora/token.py)."""
        return 0 < num_tokens <= TOKEN_PATH_MAX_TOKENS

    def weight(self, layer: int, group: str) -> torch.Tensor | None:
        """[W; A] or [W | B] of (layer, group), or None where it has no spare room."""
        return self.targets.get((layer, group))
