"""Explicit Megatron tensor-parallel layers (every collective is a visible call).

    ColumnParallelLinear   y = x W^T, W cut by output rows; merged outputs (q|k|v, gate|up)
                           are laid side by side, each cut on its own. No communication.
    RowParallelLinear      W cut by input columns; each rank's matmul is a partial sum,
                           `reduce` all-reduces it and adds the bias once.
    VocabParallelEmbedding rows of the vocabulary per rank; all-reduce of the lookups.
    ParallelLMHead         rows of the vocabulary per rank; all-gather of the logits.

Weights are loaded one Hugging Face tensor at a time from a WeightSource, each rank
reading only its own part. With `fp8=True` a linear layer keeps its weight in
float8_e4m3fn with one float32 scale per row and multiplies in FP8 (kernels/fp8.py);
otherwise FP8 checkpoint weights arrive dequantized (engine/model/loader.py). Every `load_*` checks the full tensor's shape first and raises
ModelLoadError naming the tensor and its file.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loramux_core.model import sharding
from loramux_engine.model.loader import WeightSource
from loramux_core.model.sharding import Shard
from loramux_engine.parallel import TPGroup
from loramux_kernels.elementwise import add_rms_norm, rms_norm
from loramux_kernels.fp8 import FP8, fp8_linear, quantize_rows
from loramux_core.errors import ModelLoadError


def _param(shape, dtype, device, fill: float = float("nan")) -> nn.Parameter:
    # Poisoned until loaded: a weight the loader forgot shows up as NaN, not as silence.
    return nn.Parameter(torch.full(shape, fill, dtype=dtype, device=device), requires_grad=False)


def check_shape(src: WeightSource, name: str, expected: tuple[int, ...]) -> None:
    got = src.shape(name)
    if got != tuple(expected):
        raise ModelLoadError(f"tensor {name!r} in {src.file_of(name)} has shape {list(got)}, "
                             f"expected {list(expected)}")


def _weight(shape, dtype, device, fp8: bool):
    """(weight, per-row scale or None): FP8 weights keep one float32 scale per row."""
    if not fp8:
        return _param(shape, dtype, device), None
    weight = nn.Parameter(torch.zeros(shape, dtype=FP8, device=device), requires_grad=False)
    return weight, _param(shape[:1], torch.float32, device)


def _load_fp8(src: WeightSource, name: str, weight, scale, rows: slice, shard, cols) -> None:
    """Rows `rows` of an FP8 layer from tensor `name` (its rows `shard`, columns `cols`);
    a checkpoint tensor that is not FP8 is quantized per row here."""
    if src.is_fp8(name):
        raw, s = src.read_fp8(name, rows=shard, cols=cols)
    else:
        raw, s = quantize_rows(src.read(name, rows=shard, cols=cols, dtype=torch.float32))
    weight.data[rows] = raw.to(weight.device)
    scale.data[rows] = s.reshape(-1).to(scale.device)


# Row length (elements) the storage of a weight with spare LoRA columns is padded to:
# 128-byte rows in bf16, so the base matmul's strided `weight` view keeps an aligned
# leading dimension (GEMM libraries pick their fastest kernels for those).
_ROW_ALIGN = 64


def _matmul(x: torch.Tensor, weight, scale) -> torch.Tensor:
    return F.linear(x, weight) if scale is None else fp8_linear(x, weight, scale)


def _dense(weight, scale, dtype) -> torch.Tensor:
    if scale is None:
        return weight
    return (weight.float() * scale.unsqueeze(1)).to(dtype)


class ColumnParallelLinear(nn.Module):
    """x [T, in] -> [T, sum(per-rank widths)]; output i is rows `shards[i]` of HF tensor i.

    `output_sizes` are the full (unsharded) widths; `shards` defaults to an even cut of
    each by (tp.rank, tp.size) and is given explicitly for replicated KV heads.

    `lora_cols` > 0 (not with FP8): the weight is stored with S·lora_cols zeroed columns
    beside it (S = slices), `with_lora_cols` [N, in + S·lora_cols] = [W | B], where one
    adapter's LoRA B can be copied block-diagonally (slice i's rows in columns
    in + i·lora_cols.., engine/lora/fused.py): [x | s] @ [W | B]ᵀ is then the base output
    plus that adapter's delta. `weight` stays the first `in` columns (a strided view), so
    loading and every other step are unchanged."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device, shards: list[Shard] | None = None,
                 fp8: bool = False, lora_cols: int = 0):
        super().__init__()
        self.in_features, self.dtype = in_features, dtype
        self.output_sizes = list(output_sizes)
        self.shards = shards or [sharding.even_shard(n, tp.rank, tp.size) for n in output_sizes]
        widths = [s.length for s in self.shards]
        self.offsets = [sum(widths[:i]) for i in range(len(widths))]
        self.out_widths = tuple(widths)
        self.with_lora_cols = None
        if lora_cols:
            assert not fp8, "LoRA columns beside an FP8 weight"
            width = in_features + len(widths) * lora_cols
            storage = torch.zeros((sum(widths), -(-width // _ROW_ALIGN) * _ROW_ALIGN),
                                  dtype=dtype, device=device)
            storage[:, :in_features] = float("nan")   # poisoned until loaded
            self.with_lora_cols = storage[:, :width]
            self.weight = nn.Parameter(storage[:, :in_features], requires_grad=False)
            self.weight_scale = None
        else:
            self.weight, self.weight_scale = _weight((sum(widths), in_features), dtype, device,
                                                     fp8)
        self.bias = _param((sum(widths),), dtype, device) if bias else None

    def load_weight(self, src: WeightSource, idx: int, name: str) -> None:
        """Load HF weight `name` (e.g. k_proj.weight) into output slice `idx`."""
        shard, off = self.shards[idx], self.offsets[idx]
        check_shape(src, name, (self.output_sizes[idx], self.in_features))
        rows = slice(off, off + shard.length)
        if self.weight_scale is not None:
            _load_fp8(src, name, self.weight, self.weight_scale, rows, shard, None)
        else:
            self.weight.data[rows] = src.read(name, rows=shard, dtype=self.weight.dtype)

    def load_bias(self, src: WeightSource, idx: int, name: str) -> None:
        """Load HF bias `name` into output slice `idx`."""
        assert self.bias is not None
        shard, off = self.shards[idx], self.offsets[idx]
        check_shape(src, name, (self.output_sizes[idx],))
        self.bias.data[off:off + shard.length] = src.read(name, rows=shard, dtype=self.bias.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight, self.weight_scale)

    def dense_weight(self) -> torch.Tensor:
        """This rank's weight in the model dtype (dequantized when FP8)."""
        return _dense(self.weight, self.weight_scale, self.dtype)

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The per-slice views of a merged output."""
        return y.split(self.out_widths, dim=-1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(self.matmul(x))


class RowParallelLinear(nn.Module):
    """x [T, in_shard] -> [T, out]; holds columns `in_shard` of the HF weight.

    `matmul` gives this rank's partial product; `reduce` sums the partials across ranks
    and then adds the bias (once, not once per rank).

    `lora_rows` > 0 (not with FP8): the weight is stored with that many zeroed rows
    below it, `with_lora_rows` [out + lora_rows, in_shard] = [W; A], where one adapter's
    LoRA A can be copied (engine/lora/fused.py): one GEMM then gives the base output and
    that adapter's shrink side by side. `weight` stays the first `out` rows (a
    contiguous view), so loading and every other step are unchanged."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 dtype: torch.dtype, device, in_shard: Shard | None = None, fp8: bool = False,
                 lora_rows: int = 0):
        super().__init__()
        self.tp, self.dtype = tp, dtype
        self.in_features, self.out_features = in_features, out_features
        self.in_shard = in_shard or sharding.even_shard(in_features, tp.rank, tp.size)
        shape = (out_features, self.in_shard.length)
        self.with_lora_rows = None
        if lora_rows:
            assert not fp8, "LoRA rows beside an FP8 weight"
            self.with_lora_rows = torch.zeros((out_features + lora_rows, shape[1]), dtype=dtype,
                                              device=device)
            self.with_lora_rows[:out_features] = float("nan")   # poisoned until loaded
            self.weight = nn.Parameter(self.with_lora_rows[:out_features], requires_grad=False)
            self.weight_scale = None
        else:
            self.weight, self.weight_scale = _weight(shape, dtype, device, fp8)
        self.bias = _param((out_features,), dtype, device) if bias else None

    def load_weight(self, src: WeightSource, name: str) -> None:
        check_shape(src, name, (self.out_features, self.in_features))
        if self.weight_scale is not None:
            _load_fp8(src, name, self.weight, self.weight_scale, slice(None), None,
                      self.in_shard)
        else:
            self.weight.data.copy_(src.read(name, cols=self.in_shard, dtype=self.weight.dtype))

    def load_bias(self, src: WeightSource, name: str) -> None:
        assert self.bias is not None
        check_shape(src, name, (self.out_features,))
        self.bias.data.copy_(src.read(name, dtype=self.bias.dtype))

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight, self.weight_scale)

    def dense_weight(self) -> torch.Tensor:
        """This rank's weight in the model dtype (dequantized when FP8)."""
        return _dense(self.weight, self.weight_scale, self.dtype)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.matmul(x))


class VocabParallelEmbedding(nn.Module):
    """Token ids [T] -> [T, hidden]; rank r holds vocabulary rows `sharding.vocab_range`,
    padded to the same height on every rank (padding rows are zero, never looked up)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype, device):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden = vocab_size, hidden
        self.range = sharding.vocab_range(vocab_size, tp.rank, tp.size)
        rows = sharding.padded_vocab_per_rank(vocab_size, tp.size)
        self.weight = _param((rows, hidden), dtype, device, fill=0.0)

    def load(self, src: WeightSource, name: str) -> None:
        check_shape(src, name, (self.vocab_size, self.hidden))
        if self.range.length:
            self.weight.data[:self.range.length] = src.read(name, rows=self.range, dtype=self.weight.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.range.start
        outside = (local < 0) | (local >= self.range.length)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Hidden [n, hidden] -> logits [n, vocab] float32, gathered from every rank's rows.

    With tied embeddings it shares the embedding's (identically sharded) weight."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup, dtype: torch.dtype, device,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden = vocab_size, hidden
        self.range = sharding.vocab_range(vocab_size, tp.rank, tp.size)
        rows = sharding.padded_vocab_per_rank(vocab_size, tp.size)
        self.tied = tied_to is not None
        self.weight = tied_to.weight if tied_to is not None else _param((rows, hidden), dtype, device, 0.0)

    def load(self, src: WeightSource, name: str) -> None:
        assert not self.tied
        check_shape(src, name, (self.vocab_size, self.hidden))
        if self.range.length:
            self.weight.data[:self.range.length] = src.read(name, rows=self.range, dtype=self.weight.dtype)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # gathered in the matmul's dtype, then widened: the same float32 values, half the
        # bytes over the link in bf16 (16 MB a rank at batch 64 of a 128k vocabulary)
        local = F.linear(hidden, self.weight)
        return self.tp.all_gather(local, dim=-1)[:, :self.vocab_size].float()


class RMSNorm(nn.Module):
    """Hugging Face LlamaRMSNorm exactly: normalise in float32, cast back to the input
    dtype, then multiply by the weight (in the weight's dtype)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, device):
        super().__init__()
        self.eps = eps
        self.hidden = hidden
        self.weight = _param((hidden,), dtype, device)

    def load(self, src: WeightSource, name: str) -> None:
        check_shape(src, name, (self.hidden,))
        self.weight.data.copy_(src.read(name, dtype=self.weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)  # one launch on CUDA; reference on CPU

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor):
        """(norm(residual + x), residual + x): the residual add fused into this norm (one
        launch on CUDA, where `residual` is updated in place)."""
        return add_rms_norm(x, residual, self.weight, self.eps)
