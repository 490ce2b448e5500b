"""Resolution of EngineConfig's automatic values (engine/resolve.py) from injected machine
facts, checked against the real pools and model those values size."""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from loramux_engine.config import EngineConfig
from loramux_engine.engine import Engine
from loramux_engine.kv.sizing import blocks_for_memory
from loramux_engine.lora import LoRASlotPool
from loramux_core.model.hf_config import ModelConfig, parse_config
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.parallel import TPGroup
from loramux_engine.resolve import (MAX_AUTO_LORAS, MachineFacts, adapter_bytes, resolve_config,
                            runtime_reserve_bytes, usable_gpu_bytes, weight_bytes)
from loramux_engine.server.main import build_parser, engine_config
from loramux_core.errors import InvalidRequestError

GiB = 1 << 30
LLAMA3_8B = parse_config(dict(
    architectures=["LlamaForCausalLM"], vocab_size=128256, hidden_size=4096,
    intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=500000.0, tie_word_embeddings=False, eos_token_id=128001))
H100 = MachineFacts(cuda=True, bf16=True, gpu_total_bytes=81559 << 20,  # "80 GB" as CUDA says
                    gpu_free_bytes=81000 << 20,
                    host_available_bytes=500 * GiB, cpu_count=16)
CPU = MachineFacts(cuda=False, host_available_bytes=8 * GiB, cpu_count=2)


def test_cpu_defaults_are_small_and_float32():
    c = resolve_config(EngineConfig(model="m"), LLAMA3_8B, CPU)
    assert (c.device, c.dtype, c.max_loras, c.max_cpu_loras, c.max_num_seqs,
            c.max_num_batched_tokens) == ("cpu", "float32", 4, 16, 64, 512)
    assert c.use_async_scheduling is False


def test_adapter_loaders_are_the_rank_cores_less_two_2_to_16_unless_set():
    def loaders(facts, **kw):
        return resolve_config(EngineConfig(model="m", **kw), LLAMA3_8B, facts).adapter_loaders
    assert (loaders(CPU), loaders(H100), loaders(H100, tp_size=2)) == (2, 14, 6)
    assert loaders(dataclasses.replace(H100, cpu_count=64)) == 16
    assert loaders(dataclasses.replace(H100, cpu_count=64), tp_size=8) == 6
    assert (loaders(CPU, adapter_loaders=0), loaders(H100, adapter_loaders=7)) == (0, 7)


def test_values_the_user_set_are_kept():
    c = resolve_config(EngineConfig(model="m", dtype="bfloat16", max_loras=7, max_cpu_loras=9,
                                    max_num_seqs=3, max_num_batched_tokens=100), LLAMA3_8B, H100)
    assert (c.device, c.dtype, c.max_loras, c.max_cpu_loras, c.max_num_seqs,
            c.max_num_batched_tokens) == ("cuda", "bfloat16", 7, 9, 3, 100)
    assert resolve_config(EngineConfig(model="m", max_loras=8), LLAMA3_8B, CPU).max_cpu_loras == 32
    c = resolve_config(EngineConfig(model="m", max_cpu_loras=20), LLAMA3_8B, H100)
    assert (c.max_loras, c.max_cpu_loras) == (20, 20)  # slots never outnumber host copies


def test_h100_llama8b_default_rank16_gets_hundreds_of_slots_and_most_memory_to_kv():
    c = resolve_config(EngineConfig(model="m"), LLAMA3_8B, H100)
    assert (c.device, c.dtype, c.max_lora_rank, c.max_num_seqs, c.max_num_batched_tokens) == \
        ("cuda", "bfloat16", 16, 256, 8192)
    assert adapter_bytes(LLAMA3_8B, c) == 2 * 41_943_040  # 42 M parameters, 84 MB in bf16
    assert 256 <= c.max_loras <= MAX_AUTO_LORAS, c.max_loras
    assert c.max_cpu_loras >= 2000  # 250 GB of host memory holds thousands of rank-16 copies
    after_weights = usable_gpu_bytes(c, H100) - weight_bytes(LLAMA3_8B, c) \
        - runtime_reserve_bytes(LLAMA3_8B, c)
    slots = c.max_loras * adapter_bytes(LLAMA3_8B, c)
    kv = after_weights - slots
    assert kv > after_weights / 2 and kv > 1.4 * slots, (kv / GiB, slots / GiB)
    assert kv // (128 * 1024) >= 256 * 900  # 256 sequences of 900+ tokens (128 KiB a token)


def test_slots_scale_with_rank_memory_and_utilization():
    r16 = resolve_config(EngineConfig(model="m"), LLAMA3_8B, H100).max_loras
    r64 = resolve_config(EngineConfig(model="m", max_lora_rank=64), LLAMA3_8B, H100).max_loras
    assert r64 == pytest.approx(r16 / 4, abs=1)
    low = resolve_config(EngineConfig(model="m", max_lora_rank=16, gpu_memory_utilization=0.5),
                         LLAMA3_8B, H100).max_loras
    assert low < r16 / 2
    busy = MachineFacts(cuda=True, bf16=True, gpu_total_bytes=80 * GiB,
                        gpu_free_bytes=50 * GiB, host_available_bytes=500 * GiB)
    assert resolve_config(EngineConfig(model="m"), LLAMA3_8B,
                          busy).max_loras < r16 * 0.7  # 30 GB held by another process
    tp2 = resolve_config(EngineConfig(model="m", max_lora_rank=16, tp_size=2), LLAMA3_8B, H100)
    assert tp2.max_loras > r16  # each rank holds half the weights and a part of each adapter


def test_gpu_without_bf16_gets_float16_and_few_host_copies_never_below_the_slots():
    v100 = MachineFacts(cuda=True, bf16=False, gpu_total_bytes=32 * GiB,
                        gpu_free_bytes=32 * GiB, host_available_bytes=1 * GiB)
    c = resolve_config(EngineConfig(model="m", max_lora_rank=16), LLAMA3_8B, v100)
    assert c.dtype == "float16"
    assert c.max_cpu_loras == c.max_loras  # 0.5 GB holds 5 copies; every slot needs one


def test_model_too_big_for_the_gpu_is_refused_with_the_numbers():
    small = MachineFacts(cuda=True, bf16=True, gpu_total_bytes=16 * GiB, gpu_free_bytes=16 * GiB)
    with pytest.raises(InvalidRequestError, match=r"weights \(15\.\d GiB per rank in bfloat16\)"
                                                  r".*gpu_memory_utilization=0\.9 of 16\.0 GiB"):
        resolve_config(EngineConfig(model="m"), LLAMA3_8B, small)
    with pytest.raises(InvalidRequestError, match=r"device='cuda': no CUDA device"):
        resolve_config(EngineConfig(model="m", device="cuda"), LLAMA3_8B, CPU)


def test_config_errors_name_the_field():
    with pytest.raises(InvalidRequestError, match=r"gpu_memory_utilization=1\.5: must be in"):
        EngineConfig(model="m", gpu_memory_utilization=1.5)
    with pytest.raises(InvalidRequestError, match=r"dtype='half': must be 'auto' or one of"):
        EngineConfig(model="m", dtype="half")
    with pytest.raises(InvalidRequestError, match=r"max_cpu_loras=2: must be >= max_loras=4"):
        EngineConfig(model="m", max_loras=4, max_cpu_loras=2)
    with pytest.raises(InvalidRequestError, match=r"max_num_seqs=0: must be >= 1"):
        EngineConfig(model="m", max_num_seqs=0)


def test_kv_blocks_fill_what_is_left_of_the_budget():
    block = 2 * GiB // 1000
    # 72 GB allowed, 30 GB in use, 2 GB reserve: 40 GB of blocks
    assert blocks_for_memory(80 * GiB, 50 * GiB, 0.9, 2 * GiB, block) == 40 * GiB // block
    assert blocks_for_memory(80 * GiB, 50 * GiB, 0.9, 2 * GiB, block, cap=10) == 10
    with pytest.raises(InvalidRequestError, match=r"no memory left for the KV cache: "
                                                  r"gpu_memory_utilization=0\.4 of 80\.0 GiB"):
        blocks_for_memory(80 * GiB, 50 * GiB, 0.4, 2 * GiB, block)


def test_estimates_match_the_real_model_and_slot_pool(llama_family):
    mc = ModelConfig.from_dir(llama_family.model_dir)
    c = resolve_config(EngineConfig(model="m", max_lora_rank=8), mc, CPU)
    model = LlamaForCausalLM(mc, torch.float32, torch.device("cpu"), TPGroup.single())
    assert weight_bytes(mc, c) == sum(p.nbytes for p in model.parameters())
    pool = LoRASlotPool(mc, 3, 8)
    ranks_bytes = 4 * 3 * mc.num_layers * 4  # an int32 rank per slot per (layer, group)
    assert pool.nbytes == 3 * adapter_bytes(mc, c) + ranks_bytes


@pytest.mark.engine_device("cpu")  # the CPU defaults
def test_engine_keeps_the_resolved_config_and_describes_it(llama_family):
    with Engine(EngineConfig(model=str(llama_family.model_dir), num_kv_blocks=32)) as eng:
        c = eng.config
        assert (c.device, c.dtype, c.max_loras, c.max_cpu_loras) == ("cpu", "float32", 4, 16)
        line = eng.describe()
    for part in ("device=cpu", "dtype=float32", "max_loras=4", "max_cpu_loras=16",
                 "max_num_seqs=64", "max_num_batched_tokens=512", "kv_blocks=32x16"):
        assert part in line, line


def test_server_flags_take_auto_and_numbers():
    args = build_parser().parse_args(["--model", "m", "--max-loras", "auto",
                                      "--max-num-seqs", "12", "--gpu-memory-utilization", "0.7"])
    c = engine_config(args)
    assert (c.device, c.dtype, c.max_loras, c.max_num_seqs, c.gpu_memory_utilization) == \
        ("auto", "auto", None, 12, 0.7)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-loras", "many"])


def test_cpu_threads_follow_usable_cores_and_omp_num_threads():
    many = MachineFacts(cuda=False, host_available_bytes=8 * GiB, cpu_count=16)
    assert resolve_config(EngineConfig(model="m"), LLAMA3_8B, many).cpu_threads == 16
    assert resolve_config(EngineConfig(model="m", tp_size=2), LLAMA3_8B, many).cpu_threads == 8
    omp = MachineFacts(cuda=False, host_available_bytes=8 * GiB, cpu_count=16, omp_threads=3)
    assert resolve_config(EngineConfig(model="m"), LLAMA3_8B, omp).cpu_threads == 3
    assert resolve_config(EngineConfig(model="m", cpu_threads=5), LLAMA3_8B, omp).cpu_threads == 5
    assert resolve_config(EngineConfig(model="m"), LLAMA3_8B, H100).cpu_threads is None
    assert 1 <= MachineFacts.probe("cpu").cpu_count <= (os.cpu_count() or 1)


def test_host_reserve_is_the_host_tier_on_cuda_none_on_the_cpu_bounded_by_memory():
    def reserve(facts, **kw):
        c = resolve_config(EngineConfig(model="m", **kw), LLAMA3_8B, facts)
        return c.host_reserve_loras, c.max_cpu_loras
    n, cpu_loras = reserve(H100)
    assert n == cpu_loras > 1000                    # the whole host tier, ahead
    assert reserve(CPU) == (0, 16)                  # CI machines: none unless asked
    assert reserve(CPU, host_reserve_loras=3) == (3, 16)
    assert reserve(H100, host_reserve_loras=0)[0] == 0
    assert reserve(H100, tp_size=2)[0] == 0         # one rank's reserve would not do
    # a host tier set larger than half the memory holds: the reserve stays within it
    small = dataclasses.replace(H100, host_available_bytes=8 * GiB)
    n, cpu_loras = reserve(small, max_cpu_loras=5000)
    assert cpu_loras == 5000 and n == 4 * GiB // adapter_bytes(LLAMA3_8B, resolve_config(
        EngineConfig(model="m"), LLAMA3_8B, H100))


@pytest.mark.parametrize("kw, words", [
    (dict(host_reserve_loras=-1), "must be >= 0"),
    (dict(host_reserve_loras=9, max_cpu_loras=8), "must be <= max_cpu_loras=8"),
    (dict(host_reserve_loras=4, tp_size=2), "needs tp_size=1")])
def test_host_reserve_settings_refused_with_the_reason(kw, words):
    with pytest.raises(InvalidRequestError, match=words):
        EngineConfig(model="m", **kw)
