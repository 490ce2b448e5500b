"""Building an engine's parts from its config (engine/engine.py wires them together).

`build_model_parts`: one rank's shard (the model with its weights, the LoRA slot pool, the
KV caches, the runner and its adapter reader), built alike by rank 0 and by every
tensor-parallel worker (engine/distributed/worker.py). `build_adapter_parts`: the adapter
registry, residency across the three tiers (device slots, host cache, disk) and the
adapter operations over them. At TP > 1 this
process is rank 0: the KV block count is agreed with the other ranks, and every slot load
and host-copy drop is mirrored to them by adapter id.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loramux_engine.adapters.host_cache import HostCache
from loramux_engine.adapters.loader import DiskLoader
from loramux_engine.adapters.loader_pool import LoaderPool, LoaderSpec
from loramux_engine.adapters.pins import Pins
from loramux_engine.adapters.registry import AdapterRegistry
from loramux_engine.adapters.residency import AdapterResidency
from loramux_engine.adapters.service import AdapterService
from loramux_engine.adapters.slots import SlotTable
from loramux_engine.config import EngineConfig
from loramux_engine.executor import Executor
from loramux_engine.kv.kv_cache_manager import KVCacheManager
from loramux_engine.lora import LoRASlotPool, load_lora
from loramux_engine.lora import batch as lora_batch
from loramux_engine.lora.base_copies import BaseLayers
from loramux_engine.lora.weights import check_lora
from loramux_core.adapter.plan import PlanCache
from loramux_engine.lora.host_buffers import HostBufferPool, shared_memory_pins
from loramux_engine.lora.host_reserve import HostReserve
from loramux_engine.lora.weights import full_copy_bytes
from loramux_engine.model.dummy import init_dummy_weights
from loramux_engine.model.build import build_model
from loramux_core.model.hf_config import ModelConfig
from loramux_core.model.lora_targets import lora_group_shapes
from loramux_engine.parallel import TPGroup
from loramux_engine.resolve import kv_blocks
from loramux_engine.runner import ModelRunner
from loramux_engine.sampling import Sampler
from loramux_core.safe_files import AdapterRoots


@dataclass(frozen=True)
class ModelParts:
    """One rank's shard: what rank 0 and every tensor-parallel worker build alike."""
    model: torch.nn.Module  # the architecture's model (loramux_core/model/archs)
    lora_pool: LoRASlotPool
    num_kv_blocks: int
    runner: ModelRunner
    read_adapter: Callable   # (path, expected version) -> this rank's LoRAWeights
    check_adapter: Callable | None = None  # (path, expected version) -> AdapterPlan
                                           # checked without reading the weights
    loaders: LoaderPool | None = None  # the processes read_adapter runs in, if any
    host_reserve: HostReserve | None = None  # host buffers made ahead (not yet started)
    host_buffers: HostBufferPool | None = None  # where host copies lie (collect per step)

    def close_reader(self) -> None:
        """Stop the loader processes (reads fail afterwards)."""
        if self.loaders is not None:
            self.loaders.close()


def max_model_len(config: EngineConfig, mc: ModelConfig) -> int:
    """The longest sequence served: the config's limit, at most the model's."""
    return min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)


def build_model_parts(config: EngineConfig, mc: ModelConfig, device: torch.device,
                      tp: TPGroup, agree_min: Callable[[int], int] = lambda n: n,
                      sampler: Sampler | None = None) -> ModelParts:
    """This rank's model with its weights, LoRA slot pool, KV caches and runner.
    `agree_min`: the smallest value over the ranks (every rank's cache holds the same
    blocks); `sampler`: None for the default Sampler."""
    dtype, length = config.torch_dtype, max_model_len(config, mc)
    # spare weight rows for one adapter's A (engine/lora/fused.py), where the switch is on
    model = build_model(mc, dtype, device, tp,
                        fused_lora_rank=(config.max_lora_rank
                                         if lora_batch.FUSED_LORA_GEMM != "off" else 0))
    if config.load_format == "dummy":
        init_dummy_weights(model, config.seed + tp.rank)
    else:
        model.load_weights(config.model)
    lora_pool = LoRASlotPool(mc, config.max_loras, config.max_lora_rank, dtype, device,
                             tp_size=tp.size, base_weight=model.lora_base_weight,
                             all_reduce=tp.all_reduce)
    lora_pool.allocate_extras(config.lora_extras)   # before the KV cache takes the rest
    blocks = agree_min(kv_blocks(config, mc, model.num_kv_heads_per_rank, device, length))
    kv_caches = model.make_kv_caches(blocks, config.block_size)
    # the same runner on every rank, so decode steps take the same path (graph replay
    # or eager) everywhere
    runner = ModelRunner(
        model, kv_caches, lora_pool, config.block_size, device, sampler=sampler,
        graph_max_batch=0 if config.enforce_eager else config.max_num_seqs,
        max_model_len=length, tp=tp)
    # where adapter reads land (shared memory when loader processes write them); one
    # spare made ahead, so adding an adapter of a shape already seen does not wait for
    # the driver to pin its buffer
    assert config.adapter_loaders is not None, "adapter_loaders not resolved (engine/resolve.py)"
    use_loaders = config.adapter_loaders > 0 and loaders_can_pin(device)
    buffers = HostBufferPool(pin=device.type == "cuda", spares=1, shared=use_loaders)
    plans = PlanCache()  # adapters of one shape share their header's analysis
    read = adapter_reader(config, mc, tp, buffers, plans)
    loaders = None
    if use_loaders:
        loaders = adapter_loaders(config, mc, tp, buffers, fallback=read)
        read = loaders.read
    return ModelParts(model, lora_pool, blocks, runner, reserving(read, lora_pool),
                      adapter_checker(config, mc, plans), loaders,
                      host_reserve(config, mc, tp, buffers), buffers)


def host_reserve(config: EngineConfig, mc: ModelConfig, tp: TPGroup,
                 buffers: HostBufferPool) -> HostReserve | None:
    """config.host_reserve_loras buffers of a full host copy's size (every LoRA group at
    max_lora_rank) for `buffers`, not started; None for none."""
    if not config.host_reserve_loras:
        return None
    nbytes = full_copy_bytes(mc, config.max_lora_rank, tp.size, config.torch_dtype)
    return HostReserve(buffers, nbytes, config.host_reserve_loras)


def loaders_can_pin(device: torch.device) -> bool:
    """On CUDA, loader processes only where their shared buffers can be page-locked (else
    the engine reads adapters itself, with a line on stderr saying so)."""
    if device.type != "cuda" or shared_memory_pins():
        return True
    print("engine: shared host memory cannot be page-locked on this machine; adapters are "
          "read in the engine process (adapter_loaders=0)", file=sys.stderr, flush=True)
    return False


def reserving(read: Callable, pool: LoRASlotPool) -> Callable:
    """`read`, then the pool's buffers for what the adapter needs beside its groups
    (LoRASlotPool.reserve: DoRA, lm_head / embed_tokens): a device without room for them
    refuses the adapter at its read, like a bad file, instead of failing a step."""
    def read_and_reserve(path: str, version: str | None):
        weights = read(path, version)
        pool.reserve(weights)
        return weights
    return read_and_reserve


def adapter_loaders(config: EngineConfig, mc: ModelConfig, tp: TPGroup,
                    buffers: HostBufferPool, fallback: Callable | None = None) -> LoaderPool:
    """Loader processes that read as adapter_reader does, into `buffers` (shared);
    `fallback`: the in-process read, where no loader process can be started."""
    spec = LoaderSpec(config.model, config.max_lora_rank, config.dtype,
                      tuple(config.adapter_roots), tp.rank, tp.size)
    return LoaderPool(spec, buffers, lora_group_shapes(mc, tp.size), config.torch_dtype,
                      processes=config.adapter_loaders, fallback=fallback)


def adapter_reader(config: EngineConfig, mc: ModelConfig, tp: TPGroup,
                   buffers: HostBufferPool, plans: PlanCache | None = None) -> Callable:
    """(path, expected version) -> this rank's LoRAWeights (in a buffer from `buffers`),
    read inside the adapter roots, on the calling thread."""
    roots = AdapterRoots(config.adapter_roots) if config.adapter_roots else None
    base = BaseLayers(config.model, mc.tie_word_embeddings)

    def read(path: str, version: str | None):
        return load_lora(path, mc, config.max_lora_rank, tp=tp, dtype=config.torch_dtype,
                         roots=roots, expected_version=version, buffers=buffers,
                         plan_cache=plans, base_layers=base)
    return read


def adapter_checker(config: EngineConfig, mc: ModelConfig,
                    plans: PlanCache | None = None) -> Callable:
    """(path, expected version) -> AdapterPlan: what adapter_reader's reads would refuse
    without reading the weights (engine/lora/weights.py check_lora)."""
    roots = AdapterRoots(config.adapter_roots) if config.adapter_roots else None

    def check(path: str, version: str | None):
        return check_lora(path, mc, config.max_lora_rank, roots, version, plans)
    return check


def build_adapter_parts(config: EngineConfig, parts: ModelParts, device: torch.device,
                        executor: Executor, slots: SlotTable, pins: Pins, kv: KVCacheManager
                        ) -> tuple[AdapterRegistry, AdapterResidency, AdapterService]:
    """`pins`: the engine's pin set (the slot table was built with it too)."""
    registry = AdapterRegistry()
    # rank 0 reads and validates its own shard; at TP > 1 the mirror repeats every slot
    # load and host-copy drop on the other ranks (by adapter id)
    adapters = AdapterResidency(
        registry, slots, HostCache(config.max_cpu_loras, pins),
        DiskLoader(parts.read_adapter, on_close=parts.close_reader), parts.lora_pool, device,
        mirror=executor.adapter_mirror(registry))
    return registry, adapters, AdapterService(registry, slots, pins, adapters, kv,
                                              check=parts.check_adapter)
