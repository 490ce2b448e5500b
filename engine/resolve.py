"""Deciding every automatic EngineConfig value ("auto", None) in one place.

`resolve_config(config, model_config, facts)` returns a config with every field concrete;
`MachineFacts.probe` measures the machine once (tests pass their own facts instead).

On a GPU the engine may use `gpu_memory_utilization` of the device's total memory (less
what other processes hold). It is spent in this order:

    | weights | activations + CUDA graphs | adapter slots | KV cache (the rest) |
                 (runtime_reserve_bytes)     (LORA_MEMORY_SHARE of what is left after
                                              weights and reserve, at most MAX_AUTO_LORAS)

For a Llama-3-8B in bfloat16 on an 80 GB GPU that is about 270 rank-16 slots (21 GiB)
and 32 GiB of KV cache (250,000 tokens).

Slot count and host copies are decided here, before anything is allocated (they are
sizes of preallocated pools); the KV block count is measured after the weights and slots
are in place (engine/kv/sizing.py), with the same reserve held back. On the CPU the
defaults stay small: the CPU path is for tests and demos, not throughput.
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from loramux_engine.config import EngineConfig
from loramux_engine.kv.sizing import bytes_per_block, max_useful_blocks, num_kv_blocks
from loramux_core.model.archs import architecture
from loramux_core.model.lora_targets import expert_shard_shape, lora_group_shapes
from loramux_core.errors import InvalidRequestError

GiB = 1 << 30
CPU_MAX_LORAS = 4
CPU_HOST_COPIES_PER_SLOT = 4
CPU_MAX_NUM_SEQS = 64
CPU_MAX_NUM_BATCHED_TOKENS = 512
GPU_MAX_NUM_SEQS = 256          # the CUDA-graph batch buckets go up to this
GPU_MAX_NUM_BATCHED_TOKENS = 8192
LORA_MEMORY_SHARE = 0.4         # of the GPU memory left after weights and the reserve
MAX_AUTO_LORAS = 512
HOST_MEMORY_SHARE = 0.5         # of the host memory available at start, for adapter copies
MAX_AUTO_CPU_LORAS = 8192
GRAPH_RESERVE_BYTES = GiB // 2  # CUDA graphs' private pools and the allocator's slack
ACTIVATION_SAFETY = 2           # temporaries the estimate does not name


@dataclass(frozen=True)
class MachineFacts:
    """What resolution needs to know about the machine."""
    cuda: bool                      # a CUDA device is usable
    bf16: bool = False              # that device computes in bfloat16
    gpu_total_bytes: int = 0
    gpu_free_bytes: int = 0         # free now (other processes' use is not ours to take)
    host_available_bytes: int = 0
    cpu_count: int = 1              # cores this process may use (affinity, cgroup quota)
    omp_threads: int | None = None  # $OMP_NUM_THREADS, when the user set it

    @classmethod
    def probe(cls, device: str = "auto") -> "MachineFacts":
        """Measure the machine; `device` names the GPU whose memory counts ("auto": the
        current one). CUDA is not touched when `device` is a CPU device."""
        host = dict(host_available_bytes=_host_available_bytes(), cpu_count=_usable_cpus(),
                    omp_threads=_omp_threads())
        if device.startswith("cpu") or not torch.cuda.is_available():
            return cls(cuda=False, **host)
        dev = torch.device("cuda") if device == "auto" else torch.device(device)
        free, total = torch.cuda.mem_get_info(dev)
        return cls(cuda=True, bf16=torch.cuda.is_bf16_supported(), gpu_total_bytes=total,
                   gpu_free_bytes=free, **host)


def resolve_config(config: EngineConfig, mc, facts: MachineFacts) -> EngineConfig:
    """`config` with device, dtype, max_loras, max_cpu_loras, max_num_seqs and
    max_num_batched_tokens decided (values the caller set are kept). Raises
    InvalidRequestError when the model cannot fit the memory the config allows."""
    device = resolve_device(config.device, facts)
    on_gpu = torch.device(device).type == "cuda"
    dtype = resolve_dtype(config.dtype, on_gpu, facts)
    c = dataclasses.replace(config, device=device, dtype=dtype,
                            adapter_loaders=adapter_loaders(config, facts))
    if not on_gpu:
        loras = c.max_loras or CPU_MAX_LORAS
        c = dataclasses.replace(
            c, max_loras=loras, max_cpu_loras=c.max_cpu_loras or CPU_HOST_COPIES_PER_SLOT * loras,
            cpu_threads=c.cpu_threads or cpu_threads(c, facts),
            max_num_seqs=c.max_num_seqs or CPU_MAX_NUM_SEQS,
            max_num_batched_tokens=c.max_num_batched_tokens or CPU_MAX_NUM_BATCHED_TOKENS)
        return dataclasses.replace(c, host_reserve_loras=host_reserve(c, mc, facts, False))
    c = dataclasses.replace(
        c, max_num_seqs=c.max_num_seqs or GPU_MAX_NUM_SEQS,
        max_num_batched_tokens=c.max_num_batched_tokens or GPU_MAX_NUM_BATCHED_TOKENS)
    # a host-copy limit the user set also bounds the automatic slot count
    loras = c.max_loras or min(gpu_slots(c, mc, facts), c.max_cpu_loras or MAX_AUTO_LORAS)
    c = dataclasses.replace(c, max_loras=loras,
                            max_cpu_loras=c.max_cpu_loras or host_copies(c, mc, facts, loras))
    return dataclasses.replace(c, host_reserve_loras=host_reserve(c, mc, facts, True))


def host_reserve(c: EngineConfig, mc, facts: MachineFacts, on_gpu: bool) -> int:
    """Host buffers made ready at start (engine/lora/host_reserve.py): as set, else
    max_cpu_loras on a GPU at tp_size 1 and none on the CPU (test machines run many
    engines at once: tens of GB each would not fit them); never more than max_cpu_loras
    nor than HOST_MEMORY_SHARE of the host's available memory holds in full copies."""
    wanted = c.host_reserve_loras
    if wanted is None:
        wanted = c.max_cpu_loras if on_gpu and c.tp_size == 1 else 0
    if wanted == 0:
        return 0
    fit = int(facts.host_available_bytes * HOST_MEMORY_SHARE) // adapter_bytes(mc, c)
    return max(0, min(wanted, c.max_cpu_loras, fit))


MAX_AUTO_LOADERS = 16


def adapter_loaders(c: EngineConfig, facts: MachineFacts) -> int:
    """Loader processes per rank: as set, else the rank's cores less two (its step thread
    and the rest of its process), 2 to MAX_AUTO_LOADERS. A full read of an 84 MB adapter
    costs about 130 ms of CPU, most of it per byte (the digest, the fresh pages of its host
    copy): 100 loads a second need a dozen cores, so the loaders may use every core the
    rank does not; they run at a lower priority (LoaderSpec.niceness), so the step thread
    and the other processes of the service go first. Two at least, so one stuck read never
    holds up the others."""
    if c.adapter_loaders is not None:
        return c.adapter_loaders
    return min(MAX_AUTO_LOADERS, max(2, facts.cpu_count // c.tp_size - 2))


def cpu_threads(c: EngineConfig, facts: MachineFacts) -> int:
    """$OMP_NUM_THREADS when set; else this process's usable cores shared among the
    tensor-parallel ranks (torch's own default counts every core of the machine, also
    those a container's quota or the affinity mask withholds)."""
    return facts.omp_threads or max(1, facts.cpu_count // c.tp_size)


def resolve_device(requested: str, facts: MachineFacts) -> str:
    if requested == "auto":
        return "cuda" if facts.cuda else "cpu"
    if torch.device(requested).type == "cuda" and not facts.cuda:
        raise InvalidRequestError(f"device={requested!r}: no CUDA device is available "
                                  "(use 'auto' or 'cpu')")
    return requested


def resolve_dtype(requested: str, on_gpu: bool, facts: MachineFacts) -> str:
    if requested != "auto":
        return requested
    if not on_gpu:
        return "float32"
    return "bfloat16" if facts.bf16 else "float16"


def gpu_slots(c: EngineConfig, mc, facts: MachineFacts) -> int:
    """As many slots of rank `max_lora_rank` as LORA_MEMORY_SHARE of the memory left
    after weights and the runtime reserve holds (1 to MAX_AUTO_LORAS)."""
    left = usable_gpu_bytes(c, facts) - weight_bytes(mc, c) - runtime_reserve_bytes(mc, c)
    if left <= 0:
        raise InvalidRequestError(
            f"the model's weights ({weight_bytes(mc, c) / GiB:.1f} GiB per rank in {c.dtype}) "
            f"and activations ({runtime_reserve_bytes(mc, c) / GiB:.1f} GiB) do not fit "
            f"gpu_memory_utilization={c.gpu_memory_utilization} of "
            f"{facts.gpu_total_bytes / GiB:.1f} GiB "
            f"({(facts.gpu_total_bytes - facts.gpu_free_bytes) / GiB:.1f} GiB already in use)")
    return max(1, min(MAX_AUTO_LORAS, int(left * LORA_MEMORY_SHARE) // adapter_bytes(mc, c)))


def host_copies(c: EngineConfig, mc, facts: MachineFacts, loras: int) -> int:
    """As many host copies of rank `max_lora_rank` as HOST_MEMORY_SHARE of the host's
    available memory holds, never fewer than the slots (each slot may need its copy)."""
    fit = int(facts.host_available_bytes * HOST_MEMORY_SHARE) // adapter_bytes(mc, c)
    return max(loras, min(MAX_AUTO_CPU_LORAS, fit))


def usable_gpu_bytes(c: EngineConfig, facts: MachineFacts) -> int:
    """This engine's share of the GPU, less what other processes already hold."""
    in_use = facts.gpu_total_bytes - facts.gpu_free_bytes
    return int(facts.gpu_total_bytes * c.gpu_memory_utilization) - in_use


def weight_bytes(mc, c: EngineConfig) -> int:
    """Base weights on one tensor-parallel rank (of an FP8 checkpoint: the attention and
    MLP projections in one byte per weight plus a float32 scale per row, as the GPU keeps
    them)."""
    tp, h = c.tp_size, mc.hidden_size
    projections = (h * (mc.q_size + 2 * mc.kv_size) + mc.q_size * h
                   + 3 * h * mc.intermediate_size) // tp
    per_layer = 2 * h
    if mc.quant == "fp8":
        rows = (mc.q_size + 2 * mc.kv_size + 2 * mc.intermediate_size) // tp + 2 * h
        extra = (projections + 4 * rows) * mc.num_layers
    else:
        per_layer, extra = per_layer + projections, 0
    if mc.moe is not None:  # routed experts (split along their width), router, shared gate
        m = mc.moe
        per_layer += m.num_experts * 3 * h * m.intermediate_size // tp + (m.num_experts + 1) * h
    vocab = mc.vocab_size * h * (1 if mc.tie_word_embeddings else 2) // tp
    return (mc.num_layers * per_layer + vocab + h) * _elem(c) + extra


def adapter_bytes(mc, c: EngineConfig) -> int:
    """One adapter of rank `max_lora_rank` on one rank: a device slot, or a host copy."""
    r, per_layer = c.max_lora_rank, 0
    for shape in lora_group_shapes(mc, c.tp_size).values():
        per_layer += (len(shape.out_features) * shape.in_features + sum(shape.out_features)) * r
    if mc.moe is not None:  # LoRA on the fused experts
        per_layer += sum(mc.moe.num_experts * r * sum(expert_shard_shape(mc, t.param, c.tp_size))
                         for t in architecture(mc).expert_targets)
    return mc.num_layers * per_layer * _elem(c)


def runtime_reserve_bytes(mc, c: EngineConfig) -> int:
    """GPU memory held back from the KV cache for one step's activations at the token and
    sequence budgets (hidden states, q|k|v, gate|up, logits in float32 and their softmax)
    and for CUDA graphs."""
    tp, t = c.tp_size, c.max_num_batched_tokens
    widths = 4 * mc.hidden_size + (mc.q_size + 2 * mc.kv_size + 3 * mc.intermediate_size) // tp
    if mc.moe is not None:  # per routed pair: gate|up, activation, down output
        widths += mc.moe.top_k * (3 * mc.moe.intermediate_size // tp + mc.hidden_size)
    logits = 2 * 4 * c.max_num_seqs * mc.vocab_size
    return ACTIVATION_SAFETY * (t * widths * _elem(c) + logits) + GRAPH_RESERVE_BYTES


def kv_blocks(c: EngineConfig, mc, num_kv_heads_per_rank: int, device: torch.device,
              max_model_len: int) -> int:
    """This rank's KV block count, measured once its weights and slots are in place
    (at TP > 1 the ranks then agree on the smallest)."""
    block_bytes = bytes_per_block(mc.num_layers, c.block_size, num_kv_heads_per_rank,
                                  mc.head_dim, c.torch_dtype)
    return num_kv_blocks(c.num_kv_blocks, device, c.gpu_memory_utilization,
                         runtime_reserve_bytes(mc, c), block_bytes,
                         cap=max_useful_blocks(c.max_num_seqs, max_model_len, c.block_size))


def describe(c: EngineConfig, num_kv_blocks: int, max_model_len: int) -> str:
    """One line with the resolved values a user may want to check at start-up."""
    return (f"device={c.device} dtype={c.dtype} tp={c.tp_size} max_loras={c.max_loras} "
            f"max_cpu_loras={c.max_cpu_loras} max_lora_rank={c.max_lora_rank} "
            f"max_num_seqs={c.max_num_seqs} max_num_batched_tokens={c.max_num_batched_tokens} "
            f"cpu_threads={c.cpu_threads or torch.get_num_threads()} "
            f"max_model_len={max_model_len} kv_blocks={num_kv_blocks}x{c.block_size} "
            f"({num_kv_blocks * c.block_size} tokens) "
            f"gpu_memory_utilization={c.gpu_memory_utilization} "
            f"prefix_caching={c.enable_prefix_caching} "
            f"cuda_graphs={c.device.startswith('cuda') and not c.enforce_eager} "
            f"async_scheduling={c.use_async_scheduling} adapter_loaders={c.adapter_loaders} "
            f"host_reserve_loras={c.host_reserve_loras}")


def _elem(c: EngineConfig) -> int:
    return c.torch_dtype.itemsize


def _usable_cpus() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus or 1)


def _omp_threads() -> int | None:
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return None


def meminfo() -> dict[str, int]:
    """The host's /proc/meminfo in bytes by field ("MemAvailable", "MemTotal", ...);
    empty where it cannot be read."""
    fields = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, value = line.split(":", 1)
                fields[name] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return fields


def _host_available_bytes() -> int:
    available = meminfo().get("MemAvailable")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 8 * GiB
