"""Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Qwen2-MoE) over a paged KV cache,
tensor-parallel.

The family's variations are ModelConfig flags set by each architecture's declaration
(loramux_core/model/archs/): q/k/v and o biases, RMSNorm over each query and key head before
rotary (qk_norm, Qwen3), attention limited to a sliding window (Mistral), a mixture of
experts in place of the MLP (moe, Qwen2-MoE: engine/model/moe.py).

Each rank holds its shard (loramux_core/model/sharding.py): merged column-parallel q|k|v and
gate|up, row-parallel o and down, vocabulary-parallel embedding and head. The numerics
follow transformers step by step (residual adds and activations in the model dtype,
RMSNorm in float32, attention softmax in float32) so that float32 runs match it.

LoRA enters through `lora.apply(layer_idx, group, x, y)` on each group's local matmul
output, before the bias and, for row-parallel layers, before the all-reduce (see
loramux_core/model/lora_targets.py).
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from loramux_core.model import lora_targets, sharding
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.layers import (ColumnParallelLinear, ParallelLMHead, RMSNorm,
                                 RowParallelLinear, VocabParallelEmbedding)
from loramux_engine.model.loader import WeightSource
from loramux_engine.model.moe import SparseMoeBlock
from loramux_engine.model.rotary import RotaryEmbedding
from loramux_engine.parallel import TPGroup
from loramux_kernels.attention import paged_attention
from loramux_kernels.attention_metadata import AttentionMetadata
from loramux_kernels.elementwise import silu_mul
from loramux_core.errors import ModelLoadError

KVCache = tuple[torch.Tensor, torch.Tensor]
Loader = Callable[[WeightSource, str], None]


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, dtype, device,
                 rotary: RotaryEmbedding, fp8: bool = False, fused_rank: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = cfg.head_dim
        q_rows = sharding.rows(sharding.q_heads(cfg, tp.rank, tp.size), cfg.head_dim)
        kv_rows = sharding.rows(sharding.kv_heads(cfg, tp.rank, tp.size), cfg.head_dim)
        self.num_heads = q_rows.length // cfg.head_dim
        self.num_kv_heads = kv_rows.length // cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.rotary = rotary
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [cfg.q_size, cfg.kv_size, cfg.kv_size], cfg.qkv_bias, tp,
            dtype, device, shards=[q_rows, kv_rows, kv_rows], fp8=fp8, lora_cols=fused_rank)
        self.o_proj = RowParallelLinear(cfg.q_size, cfg.hidden_size, cfg.o_bias, tp, dtype, device,
                                        in_shard=q_rows, fp8=fp8, lora_rows=fused_rank)
        # checkpoint names of the projections, as the architecture declares them
        self._names = {g: [t.module for t in lora_targets.group_targets(cfg, g)]
                       for g in ("qkv", "o")}
        self.sliding_window = cfg.sliding_window
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype, device)

    def forward(self, x: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache,
                lora) -> torch.Tensor:
        T, D = x.shape[0], self.head_dim
        if lora is None:
            qkv = self.qkv_proj.matmul(x)
        else:
            qkv = lora.matmul(self.layer_idx, "qkv", self.qkv_proj, x)
            lora.apply(self.layer_idx, "qkv", x, qkv)
        q, k, v = self.qkv_proj.split(self.qkv_proj.add_bias(qkv))
        if self.q_norm is not None:  # per head: rows of head_dim
            q = self.q_norm(q.reshape(-1, D))
            k = self.k_norm(k.reshape(-1, D))
        k_cache, v_cache = kv_cache
        # rotary on q and k and the KV-cache store in one launch on CUDA
        q, k = self.rotary.rotate_and_store(
            attn.positions, q.reshape(T, self.num_heads, D), k.reshape(T, self.num_kv_heads, D),
            v.reshape(T, self.num_kv_heads, D), k_cache, v_cache, attn.slot_mapping)
        o = paged_attention(q, k_cache, v_cache, attn, self.scale,
                            window=self.sliding_window).reshape(T, self.num_heads * D)
        if lora is None:
            return self.o_proj.reduce(self.o_proj.matmul(o))
        y = lora.matmul(self.layer_idx, "o", self.o_proj, o)
        lora.apply(self.layer_idx, "o", o, y)
        return self.o_proj.reduce(y)

    def loaders(self, prefix: str) -> dict[str, Loader]:
        out: dict[str, Loader] = {}
        for idx, name in enumerate(self._names["qkv"]):
            out[f"{prefix}.{name}.weight"] = _col_weight(self.qkv_proj, idx)
            if self.qkv_proj.bias is not None:
                out[f"{prefix}.{name}.bias"] = _col_bias(self.qkv_proj, idx)
        (o_name,) = self._names["o"]
        out[f"{prefix}.{o_name}.weight"] = self.o_proj.load_weight
        if self.o_proj.bias is not None:
            out[f"{prefix}.{o_name}.bias"] = self.o_proj.load_bias
        if self.q_norm is not None:
            out[f"{prefix}.q_norm.weight"] = self.q_norm.load
            out[f"{prefix}.k_norm.weight"] = self.k_norm.load
        return out


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, dtype, device,
                 fp8: bool = False, fused_rank: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        inter = cfg.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp,
                                                 dtype, device, fp8=fp8, lora_cols=fused_rank)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp, dtype, device,
                                           fp8=fp8, lora_rows=fused_rank)
        # checkpoint names of the projections, as the architecture declares them
        self._names = {g: [t.module for t in lora_targets.group_targets(cfg, g)]
                       for g in ("gate_up", "down")}

    def forward(self, x: torch.Tensor, lora) -> torch.Tensor:
        return self.down_proj.reduce(self.partial(x, lora))

    def partial(self, x: torch.Tensor, lora) -> torch.Tensor:
        """This rank's partial output (before the all-reduce and down_proj's bias)."""
        if lora is None:
            gate_up = self.gate_up_proj.matmul(x)
        else:
            gate_up = lora.matmul(self.layer_idx, "gate_up", self.gate_up_proj, x)
            lora.apply(self.layer_idx, "gate_up", x, gate_up)
        # [gate | up], equal widths; one launch on CUDA, which may also start down's shrink
        if lora is None:
            return self.down_proj.matmul(silu_mul(gate_up))
        h = lora.act(self.layer_idx, "down", gate_up)
        y = lora.matmul(self.layer_idx, "down", self.down_proj, h)
        lora.apply(self.layer_idx, "down", h, y)
        return y

    def loaders(self, prefix: str) -> dict[str, Loader]:
        (down,) = self._names["down"]
        out: dict[str, Loader] = {f"{prefix}.{down}.weight": self.down_proj.load_weight}
        for idx, name in enumerate(self._names["gate_up"]):
            out[f"{prefix}.{name}.weight"] = _col_weight(self.gate_up_proj, idx)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TPGroup, dtype, device,
                 rotary: RotaryEmbedding, fp8: bool = False, fused_rank: int = 0):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, tp, dtype, device, rotary, fp8,
                                        fused_rank)
        self.mlp = LlamaMLP(cfg, layer_idx, tp, dtype, device, fp8, fused_rank)
        if cfg.moe is not None:  # the dense MLP serves as the shared expert, if any
            self.mlp = SparseMoeBlock(cfg, layer_idx, tp, dtype, device,
                                      self.mlp if cfg.moe.shared_expert else None)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.layer_idx = layer_idx
        # the MLP's gate/up reads the post-attention norm's output as is (a mixture of
        # experts routes it first)
        self._mlp_group = "gate_up" if isinstance(self.mlp, LlamaMLP) else None

    def forward(self, h: torch.Tensor, attn: AttentionMetadata, kv_cache: KVCache, lora,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(mlp output, residual): the layer's output is their sum, left for the next
        norm to add (each residual add is fused into the RMSNorm after it: one launch on
        CUDA). `residual` None: h is the embedding, the residual stream's start."""
        if residual is None:
            x, residual = self._norm(self.input_layernorm, "qkv", None, h, lora)
        else:
            x, residual = self._norm(self.input_layernorm, "qkv", h, residual, lora)
        x, residual = self._norm(self.post_attention_layernorm, self._mlp_group,
                                 self.self_attn(x, attn, kv_cache, lora), residual, lora)
        return self.mlp(x, lora), residual

    def _norm(self, norm: RMSNorm, group: str | None, x: torch.Tensor | None,
              residual: torch.Tensor, lora) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(residual + x), residual + x), x None: (norm(residual), residual); the
        LoRA batch may start `group`'s shrink of the result in the same launch."""
        if lora is not None and group is not None:
            return lora.add_norm(self.layer_idx, group, x, residual, norm.weight, norm.eps)
        if x is None:
            return norm(residual), residual
        return norm.add_forward(x, residual)

    def loaders(self, prefix: str) -> dict[str, Loader]:
        return {
            **self.self_attn.loaders(f"{prefix}.self_attn"),
            **self.mlp.loaders(f"{prefix}.mlp"),
            f"{prefix}.input_layernorm.weight": self.input_layernorm.load,
            f"{prefix}.post_attention_layernorm.weight": self.post_attention_layernorm.load,
        }


class LlamaForCausalLM(nn.Module):
    """The base model on one tensor-parallel rank.

    `forward(input_ids [T], attn, kv_caches, lora=None) -> hidden [T, hidden]` runs one
    flat mixed prefill/decode step (engine/model/batch.py) and writes the new tokens' K/V
    into `kv_caches` (one (k, v) pair per layer, from `make_kv_caches`).
    `compute_logits(hidden [n, hidden]) -> [n, vocab] float32`.

    `fp8`: the attention and MLP projections keep FP8 weights and multiply in FP8
    (kernels/fp8.py); otherwise an FP8 checkpoint is dequantized at load.

    `fused_lora_rank` > 0 (one rank, no FP8, no experts): o_proj and down_proj keep that
    many rows below their weights for one adapter's LoRA A, qkv_proj and gate_up_proj
    that many columns per slice beside theirs for its B (`fused_lora_weights`,
    engine/lora/fused.py)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", tp: TPGroup = TPGroup.single(),
                 fp8: bool = False, fused_lora_rank: int = 0):
        super().__init__()
        sharding.check_divisible(cfg, tp.size)
        assert not fused_lora_rank or (tp.size == 1 and not fp8 and cfg.moe is None), \
            "fused LoRA rows at TP > 1, with FP8 or experts"
        self.fused_lora_rank = fused_lora_rank
        self.cfg, self.tp, self.dtype, self.device = cfg, tp, dtype, torch.device(device)
        rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                 cfg.rope_scaling, self.device)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype, device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, tp, dtype, device, rotary, fp8,
                                                      fused_lora_rank)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        tied = self.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, device, tied_to=tied)

    @property
    def num_kv_heads_per_rank(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def num_heads_per_rank(self) -> int:
        return self.layers[0].self_attn.num_heads

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, attn: AttentionMetadata,
                kv_caches: list[KVCache], lora=None) -> torch.Tensor:
        assert len(kv_caches) == len(self.layers), (len(kv_caches), len(self.layers))
        h, residual = self.embed_tokens(input_ids), None
        if lora is not None:
            lora.apply_embedding(input_ids, h)
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, attn, kv_cache, lora, residual)
        if lora is not None:   # what LoRA left for a norm after the last layer
            lora.finish()
        if residual is None:
            return self.norm(h)
        return self.norm.add_forward(h, residual)[0]

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor, lora=None,
                       rows: torch.Tensor | None = None) -> torch.Tensor:
        """`rows`: the flat step indices of `hidden`'s tokens, for lm_head LoRA (None:
        the step's first tokens, one per row of `hidden`)."""
        logits = self.lm_head(hidden)
        if lora is not None:
            lora.apply_head(rows, hidden, logits)
        return logits

    def make_kv_caches(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> list[KVCache]:
        """One zeroed (k_cache, v_cache) pair per layer, each
        [num_blocks, block_size, kv_heads_per_rank, head_dim]."""
        shape = (num_blocks, block_size, self.num_kv_heads_per_rank, self.cfg.head_dim)
        dtype, device = dtype or self.dtype, device or self.device
        return [(torch.zeros(shape, dtype=dtype, device=device),
                 torch.zeros(shape, dtype=dtype, device=device)) for _ in self.layers]

    def lora_group_shapes(self) -> dict[str, lora_targets.GroupShape]:
        """Per-rank (in_features, out widths per slice) of the groups LoRA applies to."""
        return lora_targets.lora_group_shapes(self.cfg, self.tp.size)

    def lora_base_weight(self, layer: int, group: str) -> torch.Tensor:
        """This rank's merged base weight [N, K] of a LoRA group (DoRA's row norms)."""
        attn, mlp = self.layers[layer].self_attn, self.layers[layer].mlp
        mlp = getattr(mlp, "shared_expert", mlp)   # a mixture of experts' dense MLP
        return {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj,
                "down": mlp.down_proj}[group].dense_weight()

    def fused_lora_weights(self) -> dict[tuple[int, str], torch.Tensor]:
        """{(layer, group): storage} of the groups whose weights keep room for one
        adapter: [W; A] [out + fused_lora_rank, in] (o, down), [W | B] [out, in + S ·
        fused_lora_rank] (qkv, gate_up); empty without them."""
        if not self.fused_lora_rank:
            return {}
        out = {}
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            out.update({(i, "qkv"): attn.qkv_proj.with_lora_cols,
                        (i, "o"): attn.o_proj.with_lora_rows,
                        (i, "gate_up"): mlp.gate_up_proj.with_lora_cols,
                        (i, "down"): mlp.down_proj.with_lora_rows})
        return out

    def load_weights(self, model_dir) -> None:
        """Load this rank's shard of every tensor from the model directory's safetensors;
        refuse missing, unexpected or mis-shaped tensors with ModelLoadError."""
        loaders = self._loaders()
        with WeightSource.open(model_dir) as src:
            present = src.names()
            _check_names(src, set(loaders), present, self.cfg.tie_word_embeddings)
            for name, load in loaders.items():
                load(src, name)

    def _loaders(self) -> dict[str, Loader]:
        out: dict[str, Loader] = {"model.embed_tokens.weight": self.embed_tokens.load,
                                  "model.norm.weight": self.norm.load}
        if not self.cfg.tie_word_embeddings:
            out["lm_head.weight"] = self.lm_head.load
        for i, layer in enumerate(self.layers):
            out.update(layer.loaders(f"model.layers.{i}"))
        return out


def _col_weight(layer: ColumnParallelLinear, idx: int) -> Loader:
    return lambda src, name: layer.load_weight(src, idx, name)


def _col_bias(layer: ColumnParallelLinear, idx: int) -> Loader:
    return lambda src, name: layer.load_bias(src, idx, name)


def _check_names(src: WeightSource, expected: set[str], present: set[str], tied: bool) -> None:
    # Tied checkpoints sometimes still store lm_head.weight (transformers ignores it too);
    # old checkpoints store rotary inv_freq buffers, which we recompute.
    ignorable = {n for n in present if n.endswith("rotary_emb.inv_freq")}
    if tied:
        ignorable.add("lm_head.weight")
    missing = sorted(expected - present)
    if missing:
        files = ", ".join(sorted({src.file_of(n) for n in present}))
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"tensor {missing[0]!r}{more} is missing from the model's "
                             f"safetensors files ({files})")
    extra = sorted(present - expected - ignorable)
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise ModelLoadError(f"unexpected tensor {extra[0]!r} in {src.file_of(extra[0])}{more}: "
                             f"the model has no such parameter")
