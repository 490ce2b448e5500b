"""Qwen2-MoE with expert LoRA and FP8 base weights on a real GPU (skipped without one):
the Triton MoE kernels inside the engine, with CUDA graphs and eagerly, token for token
equal to transformers + PEFT (float32), including an expert adapter loaded after the
graphs were captured; and the FP8 GEMM (torch._scaled_mm, Hopper or newer) close to the
dequantized model."""
import pytest
import torch

from loramux_engine import Engine, EngineConfig
from loramux_engine.model.batch import make_attention_metadata
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from tests.conftest import TinyFamily
from tests.support.fp8 import make_fp8_pair
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model
from tests.test_engine_parity import GREEDY, assert_matches, prompts_of
from tests.test_moe_parity import EXPERTS, _oracle_each

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SPECS = {
    "moe": AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "gate_proj"),
                       target_parameters=EXPERTS, seed=91),
    "moe_down": AdapterSpec(r=8, lora_alpha=16, target_modules=(), seed=92,
                            target_parameters=("down_proj",)),
    "attn": AdapterSpec(r=8, target_modules=("q_proj", "v_proj", "o_proj"), seed=93),
}
ADAPTERS = ["moe", None, "attn", "moe_down", "moe", None, "moe_down"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("cuda_moe")
    model_dir = make_model(root / "model", TinySpec(arch="qwen2_moe", seed=90))
    return TinyFamily("qwen2_moe", model_dir, {n: make_adapter(root / n, model_dir, s)
                                               for n, s in SPECS.items()})


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_mixed_batch_matches_peft(family, eager):
    eng = Engine(EngineConfig(model=str(family.model_dir), device="cuda", dtype="float32",
                              max_loras=3, max_lora_rank=16, max_num_seqs=8, block_size=8,
                              num_kv_blocks=128, max_model_len=256, enforce_eager=eager))
    try:
        assert (eng.runner.graphs is None) == eager
        prompts = prompts_of([5, 17, 1, 9, 30, 12, 3], seed=16)
        refs = _oracle_each(family, prompts, ADAPTERS)
        base = [i for i, a in enumerate(ADAPTERS) if a is None]
        outs = eng.generate([prompts[i] for i in base], GREEDY)  # graphs captured first
        assert_matches(outs, [refs[i] for i in base])
        for name, path in family.adapters.items():   # loaded after capture
            eng.add_adapter(name, path)
        assert_matches(eng.generate(prompts, GREEDY, ADAPTERS), refs)
    finally:
        eng.close()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9),
                    reason="FP8 GEMMs need compute capability 8.9 or newer")
def test_fp8_gemm_close_to_the_dequantized_model(tmp_path):
    base = make_model(tmp_path / "model", TinySpec(seed=94))
    fp8_dir, _ = make_fp8_pair(base, tmp_path / "fp8", tmp_path / "dense", per_channel=True)
    cfg = ModelConfig.from_dir(fp8_dir)
    prompt = prompts_of([24], seed=17)[0]
    logits = {}
    for keep in (False, True):
        model = LlamaForCausalLM(cfg, torch.bfloat16, "cuda", fp8=keep)
        model.load_weights(fp8_dir)
        attn = make_attention_metadata([[0, 1, 2, 3]], [0], [len(prompt)], 8, "cuda")
        hidden = model(torch.tensor(prompt, device="cuda"), attn, model.make_kv_caches(8, 8))
        logits[keep] = model.compute_logits(hidden).float()
    assert model.layers[0].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
    rel = (logits[True] - logits[False]).norm() / logits[False].norm()
    agree = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean()
    assert 0 < rel < 0.12 and agree >= 0.9
