"""The engine's configuration as plain values, and its rules.

`EngineSettings` holds every field of the engine's configuration and refuses, when made,
what the engine would refuse (a field out of range, max_cpu_loras < max_loras, ...), so
`loramux serve` can say so before any process starts without loading torch. The engine's
own EngineConfig (engine/config.py) is an EngineSettings with the torch-side derived values."""
from __future__ import annotations

from dataclasses import dataclass

from loramux_core.errors import InvalidRequestError
from loramux_core.safe_files import roots_problem

LORA_EXTRAS = ("dora", "lm_head", "embed_tokens")   # engine/lora/pool.py LoRAExtras' order


DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name (engine/config.py)
LOAD_FORMATS = ("auto", "dummy")  # dummy: random weights on the device, no weight files read
TP_ALLREDUCE = ("auto", "nccl", "symm_mem")  # engine/distributed/fast_allreduce.py


@dataclass(frozen=True)
class EngineSettings:
    """The engine's configuration as plain values, checked field by field and across
    fields when made (max_cpu_loras >= max_loras, ...); engine/config.py's EngineConfig
    adds what needs torch."""
    model: str
    device: str = "auto"            # "auto": CUDA when a GPU is present, else the CPU
    dtype: str = "auto"             # "auto": bfloat16 (float16 on GPUs without it), CPU float32
    # None below = sized from the model and the memory (engine/resolve.py)
    max_loras: int | None = None    # device slots; also the cap on distinct adapters per batch
    max_cpu_loras: int | None = None  # host copies (>= max_loras)
    max_lora_rank: int = 16         # largest adapter rank accepted; sizes slots and copies
    block_size: int = 16
    num_kv_blocks: int | None = None  # None = what gpu_memory_utilization leaves (CPU: 1024)
    # share of the GPU's total memory this engine may use: weights, adapter slots,
    # activations and CUDA graphs first, the KV cache gets the rest
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None  # running requests at most
    # torch's CPU threads (CPU device only): None = $OMP_NUM_THREADS if set, else the
    # cores this process may use (affinity, cgroup quota) shared among the TP ranks
    cpu_threads: int | None = None
    max_num_batched_tokens: int | None = None  # per-step token budget (chunked prefill)
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
    # CUDA (any tp_size), off on the CPU. True works on the CPU too (tests the logic).
    async_scheduling: bool | None = None
    # directories adapters may be read from (loramux_core/safe_files.py); empty: each
    # adapter directory named to add_adapter is trusted as its own root
    adapter_roots: tuple[str, ...] = ()
    # processes that read, check and convert adapters for each rank, writing host copies
    # into shared memory (engine/adapters/loader_pool.py); 0: reads run on threads of
    # the engine process itself; None = the rank's cores less two, 2 to 16
    adapter_loaders: int | None = None
    # host buffers for adapters' host copies made ready at start, in the background
    # (allocated, pages populated, page-locked on CUDA: engine/lora/host_reserve.py), so
    # that the first max_cpu_loras loads do not pay for fresh host memory; 0: none;
    # None = auto: max_cpu_loras on CUDA at tp_size 1 (bounded by host memory), 0 else
    host_reserve_loras: int | None = None
    # adapter features whose device buffers are taken at start (so the warm-up compiles
    # and captures their steps: engine/warmup.py) rather than at the first such adapter's
    # read: any of LORA_EXTRAS; e.g. ("dora",) takes 4 bytes per slot and output row of
    # every wrapped layer, "lm_head" / "embed_tokens" max_lora_rank x (vocab + hidden)
    lora_extras: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "adapter_roots", tuple(self.adapter_roots))
        object.__setattr__(self, "lora_extras", tuple(self.lora_extras))
        if bad := [e for e in self.lora_extras if e not in LORA_EXTRAS]:
            raise InvalidRequestError(f"lora_extras={list(self.lora_extras)}: {bad[0]!r} is "
                                      f"not one of {', '.join(LORA_EXTRAS)}")
        if (why := roots_problem(self.adapter_roots)) is not None:
            raise InvalidRequestError(why)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(
                f"dtype={self.dtype!r}: must be 'auto' or one of {sorted(DTYPES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(f"gpu_memory_utilization={self.gpu_memory_utilization}: "
                                      "must be in (0, 1]")
        if self.load_format not in LOAD_FORMATS:
            raise InvalidRequestError(
                f"load_format={self.load_format!r}: must be one of {list(LOAD_FORMATS)}")
        if self.tp_allreduce not in TP_ALLREDUCE:
            raise InvalidRequestError(
                f"tp_allreduce={self.tp_allreduce!r}: must be one of {list(TP_ALLREDUCE)}")
        if self.tp_allreduce == "symm_mem" and self.device not in ("auto",) \
                and not self.device.startswith("cuda"):
            raise InvalidRequestError(
                f"tp_allreduce='symm_mem' needs device='cuda' (device={self.device!r}): "
                "symmetric memory exists on CUDA only; use 'auto'")
        if self.tp_allreduce == "symm_mem" and self.tp_size > 8:
            raise InvalidRequestError(f"tp_allreduce='symm_mem' supports tp_size <= 8 "
                                      f"(tp_size={self.tp_size}); use 'auto' or 'nccl'")
        for name in ("max_loras", "max_cpu_loras", "max_lora_rank", "block_size", "cpu_threads",
                     "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "tp_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise InvalidRequestError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.adapter_loaders is not None and self.adapter_loaders < 0:
            raise InvalidRequestError(f"adapter_loaders={self.adapter_loaders}: must be >= 0")
        if self.host_reserve_loras is not None:
            self._check_host_reserve()
        if self.async_scheduling not in (None, True, False):
            raise InvalidRequestError(
                f"async_scheduling={self.async_scheduling!r}: must be true, false or None")

        if (self.max_loras is not None and self.max_cpu_loras is not None
                and self.max_cpu_loras < self.max_loras):
            raise InvalidRequestError(
                f"max_cpu_loras={self.max_cpu_loras}: must be >= max_loras={self.max_loras} "
                "(every adapter in a slot may need its host copy)")

    def _check_host_reserve(self) -> None:
        n = self.host_reserve_loras
        if n < 0:
            raise InvalidRequestError(f"host_reserve_loras={n}: must be >= 0")
        if n and self.tp_size > 1:
            raise InvalidRequestError(
                f"host_reserve_loras={n}: a host reserve needs tp_size=1 (tp_size="
                f"{self.tp_size}); use 0 or leave it auto")
        if self.max_cpu_loras is not None and n > self.max_cpu_loras:
            raise InvalidRequestError(
                f"host_reserve_loras={n}: must be <= max_cpu_loras={self.max_cpu_loras} "
                "(the host tier holds no more copies than that)")
