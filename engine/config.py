"""Engine configuration: one small frozen dataclass; derived values are functions."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import InvalidRequestError

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights on the device, no weight files read
TP_ALLREDUCE = ("auto", "nccl", "symm_mem")  # engine/distributed/fast_allreduce.py


@dataclass(frozen=True)
class EngineConfig:
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    max_loras: int = 4              # GPU slots; also the cap on distinct adapters per batch
    max_cpu_loras: int | None = None  # host copies; None = 4 * max_loras
    max_lora_rank: int = 64
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = sized from kv_cache_fraction (CUDA) or 1024 (CPU)
    kv_cache_fraction: float = 0.85   # share of free device memory the KV pool may take
    max_num_seqs: int = 64          # running requests at most
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    enable_prefix_caching: bool = True
    tp_size: int = 1
    enforce_eager: bool = False     # True disables CUDA graphs
    seed: int = 0
    load_format: str = "auto"       # "auto": safetensors of `model`; "dummy": random weights
    # TP > 1 on CUDA: "auto" = one-shot all-reduce over symmetric memory for decode-sized
    # messages when every rank can set it up, else NCCL; "nccl"; "symm_mem" = required
    tp_allreduce: str = "auto"
    # launch step N+1 before reading step N's tokens (engine/engine.py); None = on for
    # CUDA with tp_size 1, off otherwise. True works on the CPU too (tests the logic) and
    # with tp_size > 1 (opt-in: not yet measured on GPUs; only steps after all-greedy
    # steps overlap, others fall back to sync).
    async_scheduling: bool | None = None
    # directories adapters may be read from (engine/adapters/safe_files.py); empty: each
    # adapter directory named to add_adapter is trusted as its own root
    adapter_roots: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "adapter_roots", tuple(self.adapter_roots))
        if self.dtype not in _DTYPES:
            raise InvalidRequestError(f"dtype={self.dtype!r}: must be one of {sorted(_DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidRequestError(
                f"load_format={self.load_format!r}: must be one of {list(LOAD_FORMATS)}")
        if self.tp_allreduce not in TP_ALLREDUCE:
            raise InvalidRequestError(
                f"tp_allreduce={self.tp_allreduce!r}: must be one of {list(TP_ALLREDUCE)}")
        if self.tp_allreduce == "symm_mem" and not self.device.startswith("cuda"):
            raise InvalidRequestError(
                f"tp_allreduce='symm_mem' needs device='cuda' (device={self.device!r}): "
                "symmetric memory exists on CUDA only; use 'auto'")
        if self.tp_allreduce == "symm_mem" and self.tp_size > 8:
            raise InvalidRequestError(f"tp_allreduce='symm_mem' supports tp_size <= 8 "
                                      f"(tp_size={self.tp_size}); use 'auto' or 'nccl'")
        for name in ("max_loras", "max_lora_rank", "block_size", "max_num_seqs",
                     "max_num_batched_tokens", "tp_size"):
            if getattr(self, name) < 1:
                raise InvalidRequestError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.async_scheduling not in (None, True, False):
            raise InvalidRequestError(
                f"async_scheduling={self.async_scheduling!r}: must be true, false or None")

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def use_async_scheduling(self) -> bool:
        if self.async_scheduling is not None:
            return self.async_scheduling
        return self.tp_size == 1 and torch.device(self.device).type == "cuda"

    @property
    def cpu_lora_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else 4 * self.max_loras
