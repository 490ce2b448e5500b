"""Ranks 1..N-1 of a tensor-parallel engine: a process that runs its model shard.

It builds the same shard rank 0 builds (engine/assembly.py: model, LoRA slot pool, KV
cache of the agreed size, ModelRunner), then follows rank 0's messages until told to
stop: where adapter versions' files are, and step plans (adapter ops by id, then the
scheduled sequences) that its request mirror turns into the same SchedulerOutput rank 0
ran. It never samples; a
step's tokens (its own greedy pick, or rank 0's sampled tokens, broadcast) stay on its
device for the next step's placeholders.
"""
from __future__ import annotations

import dataclasses
import json

import torch

from loramux_engine.assembly import build_model_parts
from loramux_engine.config import EngineConfig
from loramux_engine.distributed import fast_allreduce
from loramux_engine.distributed import group as pg
from loramux_engine.distributed.channel import PlanChannel
from loramux_engine.distributed.mirror import RequestMirror
from loramux_engine.distributed.adapters import ShardCache
from loramux_engine.distributed.plan import (HOST_DROP, OP_ADD_ADAPTER, OP_SHUTDOWN, OP_STEP,
                                     OP_WARMUP, RETIRE, SLOT_LOAD, decode_add_adapter,
                                     decode_step, decode_text)
from loramux_engine.distributed.watchdog import exit_with_parent
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.sampling.sampler import SamplerOutput
from loramux_engine.warmup import WarmupPlan
from loramux_core import open_audit
from loramux_core.gc_heap import freeze_heap


class NoSampling:
    """The sampler of ranks >= 1: logits are computed (the head's all-gather is a
    collective every rank joins) and dropped; rank 0 samples, and its tokens reach this
    rank's device by a broadcast (ModelRunner._sample) and its mirror in the next plan."""

    def sample(self, logits, states) -> SamplerOutput:
        return SamplerOutput([], [], [])


def worker_main(spec_json: str) -> None:
    """Process entry (spawned by TPExecutor); `spec_json` holds the EngineConfig fields,
    this rank, the group size and the store's port."""
    spec = json.loads(spec_json)
    config = EngineConfig(**spec["config"])
    rank, size = spec["rank"], spec["size"]
    open_audit.install_from_env(f"engine-rank{rank}")
    exit_with_parent()
    device = _device(config, rank, size)
    store = pg.join_store(spec["port"])
    store.set(f"ready/{rank}", "1")
    groups = pg.connect(store, rank, size, device)
    try:
        groups = dataclasses.replace(  # the same all-reduce as rank 0 (a collective)
            groups, tp=fast_allreduce.attach(groups.tp, groups.control, config, device))
        worker = Worker(config, groups, device)
        freeze_heap()  # the shard lives until exit: a full collection never walks it
        worker.serve()
    finally:
        pg.disconnect(device)


def _device(config: EngineConfig, rank: int, size: int) -> torch.device:
    device = torch.device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    torch.set_num_threads(config.cpu_threads)  # this rank's share (engine/resolve.py)
    return device


class Worker:
    def __init__(self, config: EngineConfig, groups: pg.Groups, device: torch.device):
        self.tp, self.control = groups.tp, groups.control
        parts = build_model_parts(config, ModelConfig.from_dir(config.model), device, self.tp,
                                  lambda n: pg.agree_min(self.control, n), NoSampling())
        self.pool, self.runner = parts.lora_pool, parts.runner
        self.mirror = RequestMirror()
        self._prev = None   # the last launched step: its picked tokens stay on the device
        # this rank's shard of a version rank 0 has read and validated already (the same
        # bytes: their hash must be the version)
        self.adapters = ShardCache(parts.read_adapter)
        self._close_reader = parts.close_reader
        self.host_buffers = parts.host_buffers
        self.channel = PlanChannel(self.control, self.tp.rank)

    def serve(self) -> None:
        try:
            self._serve()
        finally:
            self._close_reader()
            self.runner.release_graphs()  # before NCCL's teardown (CudaGraphRunner.release)

    def _serve(self) -> None:
        while True:
            op, payload = self.channel.recv()
            if op == OP_SHUTDOWN:
                return
            if op == OP_ADD_ADAPTER:
                self.adapters.add(*decode_add_adapter(payload))
            elif op == OP_STEP:
                self._step(payload)
            elif op == OP_WARMUP:
                self._warm_up(payload)
            else:
                raise RuntimeError(f"rank {self.tp.rank}: unknown plan op {op}")

    def _warm_up(self, payload: torch.Tensor) -> None:
        """Rank 0's warm-up, step for step (TPExecutor.warm_up); a failure ends this
        process, which rank 0's watchdog turns into EngineDeadError."""
        report = WarmupPlan.from_json(decode_text(payload)).run(self.runner)
        pg.agree_min(self.control, report.eager_steps)

    def _step(self, payload: torch.Tensor) -> None:
        # host copies dropped since the last step (never inside a capture: releases.py)
        self.host_buffers.collect()
        plan = decode_step(payload)
        for kind, slot, adapter_id in plan.slot_ops:
            if kind == SLOT_LOAD:
                self.pool.load(slot, self.adapters.get(adapter_id))
            elif kind == HOST_DROP:
                self.adapters.drop(adapter_id)
            elif kind == RETIRE:
                self.adapters.retire(adapter_id)
            else:
                raise RuntimeError(f"rank {self.tp.rank}: unknown adapter op {kind}")
        if plan.slot_ops:  # matches rank 0's wait in TPExecutor._launch
            pg.agree_min(self.control, 0)
        out = self.mirror.apply(plan)
        if out.scheduled:  # rank 0's greedy decision: the same graph or eager pick;
            # placeholders (async scheduling) come from this rank's previous step
            self._prev = self.runner.launch(out, self._prev, plan.greedy)
