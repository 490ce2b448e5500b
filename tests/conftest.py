"""Shared session fixtures: tiny Llama (GQA) and Qwen2 (qkv bias) models, each with a set of
PEFT adapters of different ranks and features, written once per test session; and the
Hugging Face + PEFT oracle for them."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

# Without a GPU the Triton kernels run in Triton's interpreter. Triton picks interpreted or
# compiled when a kernel is decorated (at import), and pytest imports every test module
# before running any, so the choice is made here, before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loramux_core.tokenizer import Tokenizer
from tests.support.tiny import (PAD_ID, AdapterSpec, TinySpec, build_tokenizer,
                                load_hf_model, make_adapter, make_model, write_json)

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# name -> spec: different ranks; rslora; alpha_pattern (and rank_pattern); attention only
ADAPTER_SPECS = {
    "rs4": AdapterSpec(r=4, lora_alpha=8, use_rslora=True, seed=11),
    "ap8": AdapterSpec(r=8, lora_alpha=16, alpha_pattern={"v_proj": 64, "down_proj": 4},
                       rank_pattern={"gate_proj": 6}, seed=12),
    "attn32": AdapterSpec(r=32, lora_alpha=32, target_modules=ATTENTION, seed=13),
}


@dataclass(frozen=True)
class TinyFamily:
    """A tiny model directory and its adapters (name -> PEFT directory)."""
    arch: str
    model_dir: Path
    adapters: dict


def _build_family(root: Path, arch: str) -> TinyFamily:
    model_dir = make_model(root / arch / "model", TinySpec(arch=arch))
    adapters = {name: make_adapter(root / arch / name, model_dir, spec)
                for name, spec in ADAPTER_SPECS.items()}
    return TinyFamily(arch, model_dir, adapters)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny")


@pytest.fixture(scope="session")
def llama_family(tiny_root) -> TinyFamily:
    return _build_family(tiny_root, "llama")


@pytest.fixture(scope="session")
def qwen2_family(tiny_root) -> TinyFamily:
    return _build_family(tiny_root, "qwen2")


class HFOracle:
    """Hugging Face transformers + PEFT with every adapter of a family loaded; greedy
    generation of a mixed batch through `adapter_names`, left padded."""

    def __init__(self, family: TinyFamily):
        from peft import PeftModel

        names = list(family.adapters)
        base = load_hf_model(family.model_dir)
        self.model = PeftModel.from_pretrained(base, family.adapters[names[0]],
                                               adapter_name=names[0]).eval()
        for name in names[1:]:
            self.model.load_adapter(family.adapters[name], adapter_name=name)
        self.eos_id = base.config.eos_token_id

    def generate_each(self, prompts: list[list[int]], adapters: list[str | None],
                      max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        """As `generate`, one prompt at a time with only its adapter active (PEFT refuses
        `adapter_names` when an adapter is DoRA)."""
        out = []
        for prompt, adapter in zip(prompts, adapters):
            if adapter is None:
                with self.model.disable_adapter():
                    out += self.generate([prompt], None, max_new_tokens)
            else:
                self.model.set_adapter(adapter)
                out += self.generate([prompt], None, max_new_tokens)
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], adapters: list[str | None] | None,
                 max_new_tokens: int) -> list[tuple[list[int], list[float]]]:
        """(tokens, logprobs of the chosen tokens) per prompt, cut after the first EOS.
        `adapters` None: the model's active adapter for every prompt."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), PAD_ID, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        names = {} if adapters is None else {
            "adapter_names": [a if a is not None else "__base__" for a in adapters]}
        out = self.model.generate(
            input_ids=ids, attention_mask=mask, **names,
            do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=PAD_ID,
            output_logits=True, return_dict_in_generate=True)
        logprobs = torch.stack([torch.log_softmax(step.float(), -1) for step in out.logits], 1)
        results = []
        for i in range(len(prompts)):
            toks = out.sequences[i, width:].tolist()
            if self.eos_id in toks:
                toks = toks[:toks.index(self.eos_id) + 1]
            lps = [logprobs[i, t, tok].item() for t, tok in enumerate(toks)]
            results.append((toks, lps))
        return results


@pytest.fixture(scope="session")
def tok(tmp_path_factory) -> Tokenizer:
    """The tiny tokenizer alone (no model files), <s> and </s> its BOS and EOS."""
    d = tmp_path_factory.mktemp("tok")
    build_tokenizer().save(str(d / "tokenizer.json"))
    write_json(d / "tokenizer_config.json", {"bos_token": "<s>", "eos_token": "</s>"})
    return Tokenizer.from_dir(d)


@pytest.fixture(scope="session")
def llama_oracle(llama_family) -> HFOracle:
    return HFOracle(llama_family)


@pytest.fixture(scope="session")
def qwen2_oracle(qwen2_family) -> HFOracle:
    return HFOracle(qwen2_family)


# LORAMUX_TEST_DEVICE=cuda runs every in-process Engine of the suite on that device (the
# HF oracle stays on the CPU in float32): the same tests, the CUDA kernels and graphs. The
# suite compares tokens with that float32 oracle, so an engine left to dtype "auto" (which
# is bfloat16 on a GPU) computes in float32 there too; a dtype a test names is kept. A test
# of a CPU-only mechanism keeps its engines on the CPU with @pytest.mark.engine_device("cpu").
TEST_DEVICE = os.environ.get("LORAMUX_TEST_DEVICE", "cpu")
ENGINE_DEVICE = pytest.StashKey[str]()


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "engine_device(device): the device this test's in-process Engines run "
        "on, whatever LORAMUX_TEST_DEVICE says (a CPU-only mechanism, a services test)")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # before any fixture of the test is made, module-scoped ones included
    marker = item.get_closest_marker("engine_device")
    item.config.stash[ENGINE_DEVICE] = marker.args[0] if marker else TEST_DEVICE


CUDA_SUITE_LOADERS = 2   # adapter loader processes per engine under the CUDA suite
# host buffers made ahead per engine under the CUDA suite: none (the default, max_cpu_loras
# on CUDA, is sized from the host's memory for one engine a machine)
CUDA_SUITE_HOST_RESERVE = 0
if TEST_DEVICE != "cpu":   # also for the engine processes tests start on a GPU host
    os.environ.setdefault("LORAMUX_HOST_RESERVE_LORAS", str(CUDA_SUITE_HOST_RESERVE))


def placed(config, device: str):
    """`config` as the suite runs it on `device`: there, in float32 unless it names a
    dtype (the oracle's precision)."""
    dtype = "float32" if config.dtype == "auto" else config.dtype
    # the default, the rank's cores less two, is for one engine a machine: the CUDA suite
    # runs a dozen test files at once, each engine's loaders importing torch beside them
    loaders, reserve = config.adapter_loaders, config.host_reserve_loras
    if device != "cpu" and loaders is None:
        loaders = CUDA_SUITE_LOADERS
    if device != "cpu" and reserve is None:
        reserve = CUDA_SUITE_HOST_RESERVE
    return dataclasses.replace(config, device=device, dtype=dtype, adapter_loaders=loaders,
                               host_reserve_loras=reserve)


def served_engine_args() -> tuple[str, ...]:
    """Flags that put an engine server (a process of its own, which the patch below does
    not reach) where the suite's in-process engines run, in the same dtype: a served
    engine compared with an in-process one. None under the default, where both resolve
    "auto" alike."""
    return () if TEST_DEVICE == "cpu" else ("--device", TEST_DEVICE, "--dtype", "float32",
                                            "--adapter-loaders", str(CUDA_SUITE_LOADERS),
                                            "--host-reserve-loras",
                                            str(CUDA_SUITE_HOST_RESERVE))


@pytest.fixture(scope="session", autouse=True)
def engine_test_device(request):
    """The device Engine instances run on in this session (see TEST_DEVICE)."""
    if TEST_DEVICE == "cpu":
        yield TEST_DEVICE
        return
    from loramux_engine import Engine

    original = Engine.__init__

    def init_on_device(self, config):
        device = request.config.stash.get(ENGINE_DEVICE, TEST_DEVICE)
        if device != "cpu" and config.tp_size > torch.cuda.device_count():
            pytest.skip(f"tensor parallelism over {config.tp_size} ranks needs as many GPUs")
        original(self, placed(config, device))

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Engine, "__init__", init_on_device)
        yield TEST_DEVICE
