"""The base model's architecture, parsed from a Hugging Face model directory.

Supports the architectures of the model registry (loramux_core/model/archs/: Llama, Qwen2,
Qwen3, Mistral, Qwen2-MoE); each decides its own fields (biases, q/k norms, sliding window).
Reads both the transformers 4 layout (`rope_theta` + `rope_scaling`) and the
transformers 5 layout (`rope_parameters`). Anything the engine cannot run exactly is
refused with a ModelLoadError naming the file and the field.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from loramux_core.model.archs import ARCHITECTURES, MoeFields
from loramux_core.errors import ModelLoadError

SUPPORTED_ARCHS = tuple(ARCHITECTURES)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a decoder-only Llama-family model (what the engine needs, no more)."""
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: MappingProxyType | None  # None = plain RoPE; else has "rope_type"
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool                 # q/k/v projections have biases (Qwen2, attention_bias)
    o_bias: bool                   # o_proj has a bias (Llama/Qwen3 attention_bias)
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    qk_norm: bool = False          # RMSNorm per query/key head before rotary (Qwen3)
    sliding_window: int | None = None  # attend to the last N positions only (Mistral)
    moe: MoeFields | None = None   # mixture-of-experts MLP (Qwen2-MoE); intermediate_size
                                   # is then the shared expert's width
    quant: str | None = None       # "fp8": FP8 weights with scales (engine/model/loader.py)

    @property
    def q_size(self) -> int:
        """Width of all query heads (unsharded)."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads (unsharded)."""
        return self.num_kv_heads * self.head_dim

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        """Parse `path`/config.json (and generation_config.json for EOS ids, if present)."""
        path = Path(path)
        raw = _read_json(path / "config.json", required=True)
        gen = _read_json(path / "generation_config.json", required=False) or {}
        return parse_config(raw, gen)


def parse_config(raw: dict[str, Any], gen: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from the dicts of config.json and generation_config.json."""
    f = _Fields(raw)
    archs = raw.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else None
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(f"config.json: architectures={archs!r} is not supported; "
                             f"expected one of {list(SUPPORTED_ARCHS)}")
    _check_unsupported_features(raw)
    quant = _quantization(raw.get("quantization_config"))
    arch_fields = ARCHITECTURES[arch].fields(raw)
    hidden = f.int("hidden_size")
    heads = f.int("num_attention_heads")
    kv_heads = f.int("num_key_value_heads", default=heads)
    if hidden % heads and raw.get("head_dim") is None:
        raise ModelLoadError(f"config.json: hidden_size={hidden} is not divisible by "
                             f"num_attention_heads={heads} and head_dim is not given")
    head_dim = f.int("head_dim", default=hidden // heads)
    if heads % kv_heads:
        raise ModelLoadError(f"config.json: num_attention_heads={heads} is not divisible by "
                             f"num_key_value_heads={kv_heads}")
    if head_dim % 2:
        raise ModelLoadError(f"config.json: head_dim={head_dim} must be even for rotary embedding")
    max_pos = f.int("max_position_embeddings")
    theta, scaling = _rope(raw, max_pos)
    gen = gen or {}
    eos = gen.get("eos_token_id", raw.get("eos_token_id"))
    return ModelConfig(
        arch=arch,
        vocab_size=f.int("vocab_size"),
        hidden_size=hidden,
        intermediate_size=arch_fields.intermediate_size or f.int("intermediate_size"),
        num_layers=f.int("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch_fields.qkv_bias,
        o_bias=arch_fields.o_bias,
        qk_norm=arch_fields.qk_norm,
        sliding_window=arch_fields.sliding_window,
        moe=arch_fields.moe,
        quant=quant,
        torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
        eos_token_ids=_token_ids(eos, "eos_token_id"),
        bos_token_id=gen.get("bos_token_id", raw.get("bos_token_id")),
    )


class _Fields:
    """Typed reads of config.json fields with precise errors."""

    def __init__(self, raw: dict[str, Any]):
        self.raw = raw

    def int(self, name: str, default: int | None = None) -> int:
        value = self.raw.get(name)
        if value is None:
            value = default
        if value is None:
            raise ModelLoadError(f"config.json: required field {name!r} is missing")
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ModelLoadError(f"config.json: {name}={value!r} must be a positive integer")
        return value


def _check_unsupported_features(raw: dict[str, Any]) -> None:
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"config.json: hidden_act={act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise ModelLoadError("config.json: mlp_bias=true is not supported")


def _quantization(qc: Any) -> str | None:
    """"fp8" for per-tensor / per-channel FP8 weights (quant_method "fp8", float8_e4m3fn,
    `weight_scale` tensors); None without quantization; anything else refused."""
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != "fp8":
        raise ModelLoadError(f"config.json: quantization_config.quant_method={method!r} is not "
                             f"supported (only 'fp8', per-tensor or per-channel scales)")
    if qc.get("weight_block_size") is not None:
        raise ModelLoadError(f"config.json: quantization_config.weight_block_size="
                             f"{qc['weight_block_size']!r}: block-wise FP8 scales are not "
                             f"supported (per-tensor or per-channel only)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ModelLoadError(f"config.json: quantization_config.activation_scheme={scheme!r} "
                             f"is not supported ('dynamic' or 'static')")
    return "fp8"


def _rope(raw: dict[str, Any], max_pos: int) -> tuple[float, MappingProxyType | None]:
    """(rope_theta, scaling) from either config layout; scaling None means plain RoPE."""
    field = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    params = dict(raw.get(field) or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelLoadError(f"config.json: rope_theta={theta!r} must be a positive number")
    if params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError("config.json: partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"config.json: {field}.rope_type={rope_type!r} is not supported; "
                             f"expected one of {list(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta), None
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", max_pos)
        needed = _LLAMA3_KEYS
    else:
        needed = ("factor",)
    for key in needed:
        if not isinstance(params.get(key), (int, float)):
            raise ModelLoadError(f"config.json: {field}.{key} is missing or not a number "
                                 f"(required for rope_type={rope_type!r})")
    scaling = {"rope_type": rope_type, **{k: params[k] for k in needed}}
    return float(theta), MappingProxyType(scaling)


def _token_ids(value: Any, name: str) -> tuple[int, ...]:
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ModelLoadError(f"config.json: {name}={value!r} must be an integer or a list of integers")
    return tuple(ids)


def _read_json(path: Path, required: bool) -> dict[str, Any] | None:
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path.name} not found in model directory {path.parent}")
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path.name}: cannot be parsed as JSON: {e}") from e
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path.name}: top level must be a JSON object")
    return data
