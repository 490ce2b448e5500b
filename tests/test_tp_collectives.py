"""LoRA adds no communication: at TP=2 (gloo) a forward pass makes exactly the same
collectives with a mixed-adapter LoRA batch as without, and the outputs agree across ranks.

Each rank builds the real model shard, the real slot pool and real adapter shards
(load_lora(tp=...)); a TPGroup subclass counts every all-reduce and all-gather call."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file

from loramux_engine.distributed import group as pg
from loramux_engine.lora import LoRABatch, LoRASlotPool, load_lora
from loramux_engine.model.batch import make_attention_metadata
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.parallel import TPGroup


@dataclass(frozen=True)
class CountingTPGroup(TPGroup):
    counts: dict = field(default_factory=lambda: {"all_reduce": 0, "all_gather": 0})

    def all_reduce(self, t):
        self.counts["all_reduce"] += 1
        return super().all_reduce(t)

    def all_gather(self, t, dim=-1):
        self.counts["all_gather"] += 1
        return super().all_gather(t, dim)


def _forward(model, tp, kv, lora):
    """Prefill of two sequences then a decode: counts per forward and the logits."""
    tp.counts.update(all_reduce=0, all_gather=0)
    attn = make_attention_metadata([[0, 1], [2, 3]], [0, 0], [5, 3], 4)
    h = model(torch.tensor([3, 50, 7, 9, 11, 20, 21, 22]), attn, kv, lora)
    logits = model.compute_logits(h[torch.tensor([4, 7])])
    return dict(tp.counts), logits


def _run(model_dir, adapters, tp):
    cfg = ModelConfig.from_dir(model_dir)
    model = LlamaForCausalLM(cfg, tp=tp)
    model.load_weights(model_dir)
    pool = LoRASlotPool(cfg, len(adapters), 32, tp_size=tp.size)
    for slot, path in enumerate(adapters):
        pool.load(slot, load_lora(path, cfg, 32, tp=tp))
    kv = model.make_kv_caches(8, 4)
    base_counts, base = _forward(model, tp, kv, None)
    slots = torch.tensor([0, 0, 0, 0, 0, 1, -1, 2], dtype=torch.int32)
    lora_counts, lora = _forward(model, tp, kv, LoRABatch(pool, slots))
    return base_counts, base, lora_counts, lora


def _rank(rank: int, port: int, model_dir: str, adapters: list[str], out: str) -> None:
    store = pg.join_store(port)
    groups = pg.connect(store, rank, 2, torch.device("cpu"))
    tp = CountingTPGroup(rank, 2, groups.tp.group)
    base_counts, base, lora_counts, lora = _run(model_dir, adapters, tp)
    save_file({"base": base, "lora": lora,
               "counts": torch.tensor([base_counts["all_reduce"], base_counts["all_gather"],
                                       lora_counts["all_reduce"], lora_counts["all_gather"]])},
              f"{out}/rank{rank}.safetensors")


def test_lora_adds_no_collective(llama_family, tmp_path):
    store = pg.open_store()
    adapters = [str(p) for p in llama_family.adapters.values()]
    mp.spawn(_rank, args=(store.port, str(llama_family.model_dir), adapters, str(tmp_path)),
             nprocs=2)
    ranks = [load_file(tmp_path / f"rank{r}.safetensors") for r in range(2)]
    layers = ModelConfig.from_dir(llama_family.model_dir).num_layers
    # embedding all-reduce + (o, down) all-reduce per layer; one logits all-gather
    expected = [1 + 2 * layers, 1, 1 + 2 * layers, 1]
    for r in ranks:
        assert r["counts"].tolist() == expected
    torch.testing.assert_close(ranks[0]["lora"], ranks[1]["lora"], rtol=0, atol=0)
    assert (ranks[0]["lora"] - ranks[0]["base"]).abs().max() > 1e-2  # LoRA was applied
    # and the sharded LoRA computes what one rank computes
    single = CountingTPGroup(0, 1, None)
    _, base, _, lora = _run(str(llama_family.model_dir), adapters, single)
    torch.testing.assert_close(ranks[0]["base"], base, rtol=0, atol=1e-4)
    torch.testing.assert_close(ranks[0]["lora"], lora, rtol=0, atol=1e-4)
