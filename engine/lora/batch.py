"""The LoRA view of one forward step: which slot each token uses, applied layer by layer.

The model calls `apply(layer_idx, group, x, y)` for each LoRA group of each layer (see
loramux_core/model/lora_targets.py); per-step metadata is built once here, not per layer,
and which kernels run is kernels/lora/plan.py's choice from the step's hints (`uniform`,
`spread`). With FUSED_NORM_SHRINK the model asks `add_norm` for the add + RMSNorm
whose output is a group's input (q/k/v, gate/up): the group's shrink then runs in that
same launch (kernels/lora/norm_shrink.py) and `apply` only expands (one launch less
per group, and the norm's output is not read back for the shrink). FUSED_SILU_SHRINK does
the same for down_proj with the MLP's activation (`act`, kernels/lora/silu_shrink.py).

With FUSED_LORA_GEMM, a step whose rows all use the adapter installed in the model's
spare weight rows and columns (engine/lora/fused.py) gets o's and down's shrink from
their base GEMM (`matmul`) and `apply` only expands ("rows"); q/k/v's and gate/up's
finished shrink comes out of the norm before them beside its output (`add_norm`), their
GEMM adds the delta, and `apply` does nothing ("cols"); o's and down's expand is left to
the norm after them too (the next one reads their output: `add_norm` adds it before the
residual), or to `finish` for the last down ("all").
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from loramux_engine.lora.fused import FusedAdapter
from loramux_engine.lora.pool import LoRAExtras, LoRASlotPool
from loramux_kernels import lora as lora_kernels
from loramux_kernels.elementwise import add_rms_norm, rms_norm, silu_mul
from loramux_kernels.moe import ExpertLoRA

# The shrink of q/k/v and gate/up inside the add + RMSNorm before them, on CUDA up to 256
# tokens: "off", "uniform" (steps whose rows share one adapter), "mixed" (steps whose
# rows do not) or "all" (any mapping). Measured on an H100 (Llama-3-8B shape, rank 16,
# benchmarks/results/2026-11-27-h100/decode_mixed_paths_norm_shrink.json, norm_shrink.txt;
# 2026-11-27-h200-loads/NOTES.md): fusing both saves 0.6 ms
# of a 10.6 ms step at B=64 with 64 adapters, and the norms' fusion pays with one adapter
# too, but the SiLU's costs that case 0.28 ms (its one-adapter launch takes 16 us against
# 7.4 us for the activation and the shrink apart): so the norms fuse always, the SiLU on
# mixed steps only.
FUSED_NORM_SHRINK = "all"
NORM_SHRINK_MODES = ("off", "uniform", "mixed", "all")
# The same for down_proj's shrink inside the SiLU-and-multiply before it (`act`).
FUSED_SILU_SHRINK = "mixed"
# One adapter for every row of a step (a uniform decode graph, an eager step on one slot)
# inside the base GEMMs, where the model has room for it (CUDA, one rank, no FP8, no
# experts; engine/lora/fused.py): "off"; "rows": o's and down's shrink as extra output
# rows of their GEMMs, [W; A]; "cols": also q/k/v's and gate/up's expand as extra input
# columns, [W | B], their shrink finished in the norm before them; "all": also o's and
# down's expand inside the norm after them (no LoRA launch of a layer's own). Read when
# a step's LoRABatch is made; benchmarks/bench_decode.py --lora-gemm off,rows,cols,all
# measures each in one run. On an H200 (Llama-3-8B shape, rank 16, one adapter for all
# rows; benchmarks/results/2026-11-28-h200-round5/decode-lora-gemm-d91142e.log), ms per
# step at B = 1 / 64 / 256: off 5.76 / 6.70 / 11.18, rows 5.45 / 6.31 / 10.72, cols
# 8.72 / 9.38 / 13.29, all 7.88 / 8.62 / 14.25 (base 4.81 / 5.52 / 9.37): the norm that
# writes its finished shrink as columns (kernels/lora/norm_shrink_cols.py, no split-K:
# 12 shrink programs at 64 rows) costs more than the launches it saves, so "rows".
FUSED_LORA_GEMM = "rows"
LORA_GEMM_MODES = ("off", "rows", "cols", "all")


def spread_over_adapters(slot_rows: Iterable[tuple[int, int]], min_rows: int) -> bool:
    """Whether a batch's rows with an adapter average fewer than `min_rows` rows per
    adapter (more distinct adapters than rows / min_rows): the `spread` hint of LoRABatch.
    `slot_rows`: (slot, rows) per request, slot -1 (base model) not counted; host ints the
    step already has, so no device sync. `min_rows` from loramux_kernels.lora.mixed_min_rows for
    the step's token count; 0 (the hint changes nothing there): never spread."""
    if min_rows <= 0:
        return False
    rows, slots = 0, set()
    for slot, n in slot_rows:
        if slot >= 0:
            rows += n
            slots.add(slot)
    return len(slots) * min_rows > rows


def fused_gemm(fused: FusedAdapter | None, num_tokens: int,
               extras: LoRAExtras) -> FusedAdapter | None:
    """`fused` where a step of `num_tokens` rows that all use its installed adapter takes
    the fused GEMM (FUSED_LORA_GEMM, the token-sized expand's sizes, no `extras`), else
    None. The caller installs the step's slot in it first."""
    assert FUSED_LORA_GEMM in LORA_GEMM_MODES, FUSED_LORA_GEMM
    if (FUSED_LORA_GEMM != "off" and fused is not None and fused.fits(num_tokens)
            and not any(extras)):
        return fused
    return None


def _fuses(setting: str, uniform: bool) -> bool:
    """Whether a FUSED_*_SHRINK setting fuses the shrinks of a step (`uniform`: its rows
    share one adapter)."""
    return setting == "all" or setting == ("uniform" if uniform else "mixed")


class LoRABatch:
    """Adds every token's adapter delta for one step.

    `token_slots[t]` is the pool slot of token t's adapter, -1 for the base model. The
    tensor must stay alive and unchanged for the step (a CUDA graph may hold it).
    `uniform`: the tokens (likely) share one adapter, which picks the kernels' launch
    parameters tuned for that (a CUDA graph captured so serves such batches best).
    `spread`: the rows average few rows per adapter (`spread_over_adapters`), which keeps
    a mixed decode batch on the token kernels (kernels/lora/plan.py).
    `extras`: DoRA's row factors, lm_head and embed_tokens LoRA, each run for every row
    (indexed by its slot: rows of other slots get factor 1 or nothing) where set; None:
    whatever the pool has buffers for (right for any rows; the runner passes what the
    step's slots need, `LoRASlotPool.extras_of`). Nothing here reads the slots on the
    host, so a CUDA graph may capture it.
    `fused`: every row with an adapter uses the one installed in these spare weight rows
    (FusedAdapter.install, done by the caller); with FUSED_LORA_GEMM, o's and down's
    shrinks then ride in their base GEMMs (`matmul`). Not with `extras` (DoRA, ends)."""

    def __init__(self, pool: LoRASlotPool, token_slots: torch.Tensor, meta=None,
                 uniform: bool = False, spread: bool = False,
                 extras: LoRAExtras | None = None, fused: FusedAdapter | None = None):
        assert token_slots.dim() == 1, token_slots.shape
        self.pool = pool
        self.uniform = uniform
        self.spread = spread
        self.extras = pool.extras_allocated if extras is None else extras
        self.token_slots = token_slots
        self._ahead: dict[tuple[int, str], tuple] = {}   # shrinks run fused, to expand
        self._fuse_norm = _fuses(FUSED_NORM_SHRINK, uniform)   # read once: a step's setting
        self._fuse_silu = _fuses(FUSED_SILU_SHRINK, uniform)
        self._gemm = fused_gemm(fused, token_slots.shape[0], self.extras)
        self._cols = FUSED_LORA_GEMM in ("cols", "all")   # read once: a step's setting
        self._fold = FUSED_LORA_GEMM == "all"
        self._rows_ahead: dict[tuple[int, str], torch.Tensor] = {}   # shrinks from a GEMM
        self._cols_ahead: dict[tuple[int, str], torch.Tensor] = {}   # [x | s] for a GEMM
        self._in_gemm: set[tuple[int, str]] = set()   # groups whose GEMM added the delta
        self._no_bias: set[tuple[int, str]] = set()   # row groups whose y the norm reads
        self._pending: dict[tuple[int, str], tuple] = {}   # expands for the norm before a key
        if self._gemm is not None:   # down's shrink comes from its GEMM, not the SiLU's
            self._fuse_silu = False
        self.meta = meta if meta is not None else lora_kernels.build_meta(
            token_slots, pool.max_loras, uniform=uniform)
        pool.settle_dora()

    @property
    def num_tokens(self) -> int:
        return self.token_slots.shape[0]

    def apply_embedding(self, ids: torch.Tensor, h: torch.Tensor) -> None:
        """h [T, hidden] += each token's embed_tokens LoRA delta (B·A[:, id]), in place."""
        if self.extras.embed:
            a, b = self.pool.end_weights("embed_tokens")
            lora_kernels.add_embedding_lora(h, ids, a, b, self.token_slots, self.meta)

    def apply_head(self, rows: torch.Tensor | None, hidden: torch.Tensor,
                   logits: torch.Tensor) -> None:
        """logits [n, vocab] += the lm_head LoRA delta of the tokens `rows` (flat indices of
        this step's tokens; None: the first n) whose hidden states `hidden` [n, hidden] are."""
        if not self.extras.head:
            return
        a, b = self.pool.end_weights("lm_head")
        n = logits.shape[0]
        slots = self.token_slots[rows] if rows is not None else self.token_slots[:n]
        every_row = rows is None and n == self.num_tokens   # this step's meta fits
        lora_kernels.add_lora(logits, hidden, a[:, None], b, slots, (0, b.shape[1]),
                              meta=self.meta if every_row else None,
                              uniform=self.uniform)

    def expert_lora(self, layer_idx: int) -> ExpertLoRA | None:
        """The expert LoRA of a mixture-of-experts layer for this step (kernels/moe.py);
        None where the model has none or, off CUDA, while no adapter in the pool has any
        (on CUDA always given, so that a captured graph serves adapters loaded later)."""
        if not self.pool.expert_slots and not self.token_slots.is_cuda:
            return None
        gate_up, down = self.pool.expert_params
        a13, b13 = self.pool.expert_weights(layer_idx, gate_up)
        a2, b2 = self.pool.expert_weights(layer_idx, down)
        if a13 is None and a2 is None:
            return None
        return ExpertLoRA(self.token_slots, a13, b13, a2, b2)

    def add_norm(self, layer_idx: int, group: str, x: torch.Tensor | None,
                 residual: torch.Tensor, weight: torch.Tensor, eps: float):
        """(rms_norm(residual + x), residual + x) for the norm whose output is `group`'s
        input (x None: (rms_norm(residual), residual)). With FUSED_NORM_SHRINK, the same
        launch starts the group's shrink of that output and `apply` only expands; the new
        residual may then be a new tensor rather than `residual` updated in place. With
        the fused GEMM, the norm writes the group's finished shrink beside its output
        instead, for `matmul`."""
        if self._takes_cols(layer_idx, group):
            a, _, ranks, _ = self.pool.weights(layer_idx, group)
            both, residual = lora_kernels.add_norm_shrink_cols(
                x, residual, weight, eps, a, self.token_slots, ranks,
                self._delta_for(layer_idx, group, x))
            self._cols_ahead[(layer_idx, group)] = both
            return both[:, :residual.shape[1]], residual
        if self._fuse_norm:
            fused = self._fused_shrink(layer_idx, group, lora_kernels.norm_shrink_ahead,
                                       x, residual, weight, eps)
            if fused is not None:
                return fused
        if x is None:
            return rms_norm(residual, weight, eps), residual
        return add_rms_norm(x, residual, weight, eps)

    def act(self, layer_idx: int, group: str, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of gate_up = [gate | up], the input of `group` (down_proj).
        With FUSED_SILU_SHRINK, the same launch starts the group's shrink of it and
        `apply` only expands."""
        if self._fuse_silu:
            fused = self._fused_shrink(layer_idx, group, lora_kernels.silu_shrink_ahead,
                                       gate_up)
            if fused is not None:
                return fused[0]
        return silu_mul(gate_up)

    def _fused_shrink(self, layer_idx: int, group: str, launch, *inputs):
        """`launch(*inputs, a, token_slots, offsets, ranks, ...)` (a fused op + `group`'s
        shrink): its outputs without the shrink, which `apply` then expands; None where
        it does not run (the unfused path then)."""
        a, _, ranks, offsets = self.pool.weights(layer_idx, group)
        fused = launch(*inputs, a, self.token_slots, offsets, ranks, meta=self.meta,
                       uniform=self.uniform)
        if fused is None:
            return None
        self._ahead[(layer_idx, group)] = fused[-1]
        return fused[:-1]

    def matmul(self, layer_idx: int, group: str, linear, x: torch.Tensor) -> torch.Tensor:
        """`linear`'s (group's base layer's) matmul of x, before `apply`. With the fused
        GEMM, x @ [W; A]ᵀ: the base output is returned (a view of the first columns) and
        the shrink in the last ones is left for `apply`; or [x | s] @ [W | B]ᵀ from
        `add_norm`'s buffer: base output and delta at once."""
        storage = self._gemm.weight(layer_idx, group) if self._gemm is not None else None
        if storage is None:
            return linear.matmul(x)
        both = self._cols_ahead.pop((layer_idx, group), None)
        if both is not None:
            self._in_gemm.add((layer_idx, group))
            return F.linear(both, storage)
        if self._gemm.columns(layer_idx, group):   # not this step's: the usual way
            return linear.matmul(x)
        out = F.linear(x, storage)
        n = storage.shape[0] - self.pool.max_lora_rank
        self._rows_ahead[(layer_idx, group)] = out[:, n:]
        if linear.bias is None:   # the next norm reads this output as is
            self._no_bias.add((layer_idx, group))
        return out[:, :n]

    def _delta_for(self, layer_idx: int, group: str, x: torch.Tensor | None):
        """The expand left for the norm before (layer_idx, group), as (d, b, ranks) for
        loramux_kernels.lora.add_norm_shrink_cols, when that norm adds to the output it was left
        on; otherwise (another tensor: not expected) it is added here first, and None."""
        pending = self._pending.pop((layer_idx, group), None)
        if pending is None:
            return None
        y, rows, b, ranks = pending
        if x is None or (x.data_ptr(), x.shape, x.stride()) != (y.data_ptr(), y.shape,
                                                                y.stride()):
            lora_kernels.expand_rows(y, rows, b, self.token_slots, ranks, self.meta)
            return None
        return rows, b, ranks

    def _norm_after(self, layer_idx: int, group: str) -> tuple[int, str] | None:
        """The group whose fused norm reads `group`'s output (o: gate_up of the layer,
        down: q/k/v of the next), where that norm takes the expand; None: none does."""
        after = (layer_idx, "gate_up") if group == "o" else (layer_idx + 1, "qkv")
        if self._fold and (layer_idx, group) in self._no_bias and self._takes_cols(*after):
            return after
        return None

    def _takes_cols(self, layer_idx: int, group: str) -> bool:
        """Whether (layer_idx, group) gets its delta from its GEMM over [x | s] this step."""
        return self._cols and self._gemm is not None and self._gemm.columns(layer_idx, group)

    def finish(self) -> None:
        """Add the expands no norm took (the last layer's down: the model's final norm
        is not LoRA's); the model calls it after its last layer."""
        for y, rows, b, ranks in self._pending.values():
            lora_kernels.expand_rows(y, rows, b, self.token_slots, ranks, self.meta)
        self._pending.clear()

    def apply(self, layer_idx: int, group: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += LoRA delta of `group` in layer `layer_idx`, in place (x, y: this rank's
        shards). With the fused GEMM, o's and down's delta is added to y by the next
        `add_norm` that reads y (or by `finish`), not here."""
        a, b, ranks, offsets = self.pool.weights(layer_idx, group)
        shrunk = self._ahead.pop((layer_idx, group), None)
        rows = self._rows_ahead.pop((layer_idx, group), None)
        if (layer_idx, group) in self._in_gemm:   # the GEMM added it (`matmul`)
            self._in_gemm.discard((layer_idx, group))
        elif rows is not None:             # the shrink from the base GEMM (`matmul`)
            after = self._norm_after(layer_idx, group)
            if after is not None:          # the norm after adds it (`add_norm`)
                self._pending[after] = (y, rows, b, ranks)
            else:
                lora_kernels.expand_rows(y, rows, b, self.token_slots, ranks, self.meta)
        elif shrunk is not None:           # started inside add_norm or act
            lora_kernels.expand_after(shrunk, b, y)
        else:
            lora_kernels.add_lora(y, x, a, b, self.token_slots, offsets, ranks=ranks,
                                  meta=self.meta, uniform=self.uniform,
                                  spread=self.spread)
        if self.extras.dora:  # DoRA: y (before the bias) scaled per row by its slot's factors
            lora_kernels.scale_rows(y, self.pool.dora_scale(layer_idx, group), self.token_slots)
