"""FP8 base weights (quant_method "fp8": float8_e4m3fn weights with float32 per-tensor or
per-channel `weight_scale`): the CPU reference path dequantizes them at load and is
token for token equal to transformers + PEFT over the dequantized float32 model (LoRA in
the batch, Llama per channel, Qwen2-MoE per tensor with its experts; one rank and two); the FP8 GEMM
(torch._scaled_mm, per-token activation scales; Hopper's path) against its reference and,
as a whole model, close to the dequantized one; malformed FP8 checkpoints refused."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux_core.errors import ModelLoadError
from loramux_engine import Engine, EngineConfig
from loramux_engine.model.batch import make_attention_metadata
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.model.llama import LlamaForCausalLM
from loramux_kernels.fp8 import FP8_MAX, dequant_linear_ref, fp8_linear, quantize_rows
from tests.conftest import TEST_DEVICE, TinyFamily
from tests.support.fp8 import make_fp8_pair, quantize
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model
from tests.test_engine_parity import GREEDY, assert_matches, make_engine, prompts_of
from tests.test_moe_parity import _oracle_each

LENGTHS = [9, 1, 17, 30, 5, 12]
ADAPTERS = ["lora", None, "attn", "lora", None, "attn"]
CASES = {"llama_per_channel": (TinySpec(seed=80), True),
         "qwen2_moe_per_tensor": (TinySpec(arch="qwen2_moe", seed=81), False)}


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    """(FP8 family, dequantized family): the same adapters over both."""
    root = tmp_path_factory.mktemp(request.param)
    spec, per_channel = CASES[request.param]
    fp8_dir, dense_dir = make_fp8_pair(make_model(root / "model", spec), root / "fp8",
                                       root / "dense", per_channel)
    adapters = {"lora": make_adapter(root / "lora", dense_dir, AdapterSpec(r=8, seed=82)),
                "attn": make_adapter(root / "attn", dense_dir, AdapterSpec(
                    r=4, target_modules=("q_proj", "v_proj", "o_proj"), seed=83))}
    return (TinyFamily(spec.arch, fp8_dir, adapters), TinyFamily(spec.arch, dense_dir, adapters))


def _cpu_only():
    if TEST_DEVICE != "cpu":  # on CUDA the engine multiplies in FP8: tests/test_cuda_moe.py
        pytest.skip("the dequantized reference path is the CPU engine's")


def test_reference_path_matches_the_dequantized_model(pair):
    _cpu_only()
    fp8, dense = pair
    assert ModelConfig.from_dir(fp8.model_dir).quant == "fp8"
    assert any(v.dtype == torch.float8_e4m3fn
               for v in load_file(fp8.model_dir / "model.safetensors").values())
    prompts = prompts_of(LENGTHS, seed=14)
    refs = _oracle_each(dense, prompts, ADAPTERS)  # PEFT batches no adapters over MoE
    assert_matches(make_engine(fp8).generate(prompts, GREEDY, ADAPTERS), refs)


def test_reference_path_over_two_ranks(pair):
    """Each rank dequantizes only its rows / columns (per-channel scales cut with the
    rows): two gloo ranks still equal transformers over the dequantized model."""
    _cpu_only()
    fp8, dense = pair
    prompts = prompts_of(LENGTHS[:4], seed=18)
    refs = _oracle_each(dense, prompts, ADAPTERS[:4])
    eng = Engine(EngineConfig(model=str(fp8.model_dir), tp_size=2, device="cpu",
                              dtype="float32", max_loras=2, max_lora_rank=16, block_size=8,
                              num_kv_blocks=128, max_num_batched_tokens=32))
    try:
        for name, path in fp8.adapters.items():
            eng.add_adapter(name, path)
        assert_matches(eng.generate(prompts, GREEDY, ADAPTERS[:4]), refs)
    finally:
        eng.close()


@pytest.mark.parametrize("M,K,N", [(1, 64, 32), (7, 128, 96), (33, 64, 64)])
def test_fp8_gemm_matches_its_reference(M, K, N):
    """_scaled_mm with row-wise scales equals the product of the dequantized operands."""
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen) * 3
    wq, ws = quantize(torch.randn(N, K, generator=gen) * 0.1, per_channel=True)
    xq, xs = quantize_rows(x)
    want = (xq.float() * xs) @ (wq.float() * ws).T
    got = fp8_linear(x, wq, ws.reshape(-1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    exact = dequant_linear_ref(x, wq, ws.reshape(-1))  # activations unquantized
    assert (got - exact).abs().max() < 0.1 * exact.abs().max()


def test_fp8_gemm_model_is_close_to_the_dequantized_model(pair):
    """The FP8-GEMM model (weights kept in FP8, activations quantized per token) against
    the dequantized model: logits within a few percent (relative L2), the same greedy
    token nearly everywhere. (Accuracy and speed on a GPU: benchmarks/bench_fp8.py.)"""
    fp8, _ = pair
    cfg = ModelConfig.from_dir(fp8.model_dir)
    prompt = prompts_of([24], seed=15)[0]
    logits = {}
    for keep in (False, True):
        model = LlamaForCausalLM(cfg, fp8=keep)
        model.load_weights(fp8.model_dir)
        attn = make_attention_metadata([[0, 1, 2, 3, 4, 5]], [0], [len(prompt)], 4)
        hidden = model(torch.tensor(prompt), attn, model.make_kv_caches(8, 4))
        logits[keep] = model.compute_logits(hidden)
    layer = model.layers[0].self_attn.qkv_proj
    assert layer.weight.dtype == torch.float8_e4m3fn and torch.isfinite(layer.weight_scale).all()
    rel = (logits[True] - logits[False]).norm() / logits[False].norm()
    agree = (logits[True].argmax(-1) == logits[False].argmax(-1)).float().mean()
    # e4m3 keeps 3 mantissa bits (up to 6% per rounded activation); measured: about 7%
    # on these wide random weights, every argmax kept
    assert 0 < rel < 0.12
    assert agree >= 0.9


def _edited(pair, tmp_path, tensors=None, config=None):
    src = pair[0].model_dir
    d = shutil.copytree(src, tmp_path / "edited")
    if tensors:
        t = load_file(d / "model.safetensors")
        tensors(t)
        save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    if config:
        raw = json.loads((d / "config.json").read_text())
        raw["quantization_config"].update(config)
        (d / "config.json").write_text(json.dumps(raw))
    return d


@pytest.mark.parametrize("change,words", [
    ({"quant_method": "awq"}, "quant_method='awq'"),
    ({"weight_block_size": [128, 128]}, "block-wise"),
    ({"activation_scheme": "per_group"}, "activation_scheme")])
def test_configs_refused(pair, tmp_path, change, words):
    with pytest.raises(ModelLoadError, match="quantization_config") as ei:
        ModelConfig.from_dir(_edited(pair, tmp_path, config=change))
    assert words in str(ei.value)


Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("edit,words", [
    (lambda t: t.pop(Q0.removesuffix("weight") + "weight_scale"), "has no"),
    (lambda t: t.update({Q0.removesuffix("weight") + "weight_scale": torch.ones(2, 2)}),
     "per tensor"),
    (lambda t: t.update({Q0: t[Q0].float().to(torch.float8_e5m2)}), "float8_e4m3fn")])
def test_malformed_checkpoints_refused(pair, tmp_path, edit, words):
    d = _edited(pair, tmp_path, tensors=edit)
    model = LlamaForCausalLM(ModelConfig.from_dir(d))
    with pytest.raises(ModelLoadError, match=words) as ei:
        model.load_weights(d)
    assert "q_proj" in str(ei.value)


def test_dummy_weights_fill_fp8_layers(pair):
    """load_format="dummy" (GPU benchmarks of full-size FP8 shapes): FP8 matrices drawn
    N(0, 1) with row scales 1/sqrt(in), the same law as the dense dummy weights."""
    from loramux_engine.model.dummy import init_dummy_weights

    cfg = ModelConfig.from_dir(pair[0].model_dir)
    model = LlamaForCausalLM(cfg, fp8=True)
    init_dummy_weights(model, seed=1)
    o = model.layers[0].self_attn.o_proj
    assert o.weight.dtype == torch.float8_e4m3fn and 0.5 < o.weight.float().std() < 2
    torch.testing.assert_close(o.weight_scale, torch.full_like(o.weight_scale, cfg.q_size ** -0.5))
    attn = make_attention_metadata([[0, 1]], [0], [5], 4)
    hidden = model(torch.tensor([3, 4, 5, 6, 7]), attn, model.make_kv_caches(4, 4))
    assert torch.isfinite(hidden).all()


def test_memory_sizing_counts_fp8_bytes(pair):
    """engine/resolve.py's weight estimate equals the FP8-GEMM model's parameters (one byte
    per projection weight, a float32 scale per row; biases left out as for every model)."""
    from loramux_engine.resolve import weight_bytes

    cfg = ModelConfig.from_dir(pair[0].model_dir)
    model = LlamaForCausalLM(cfg, fp8=True)
    want = sum(p.nbytes for name, p in model.named_parameters() if not name.endswith("bias"))
    assert weight_bytes(cfg, EngineConfig(model="m", dtype="float32")) == want


def test_quantize_kernel_runs_as_this_machine_needs():
    from tests.support.triton_mode import check_kernel_mode
    check_kernel_mode(pytest.importorskip("loramux_kernels.fp8_triton"))


@pytest.mark.parametrize("M,K", [(1, 64), (5, 300), (3, 2500)])
def test_quantize_kernel_matches_quantize_rows(M, K):
    """The one-launch activation quantization (kernels/fp8_triton.py) against the torch
    ops of quantize_rows: the same scales, the same FP8 values (a zero row included)."""
    fp8_triton = pytest.importorskip("loramux_kernels.fp8_triton")
    gen = torch.Generator().manual_seed(K)
    x = (torch.randn(M, K, generator=gen) * 3).bfloat16()
    if M > 1:
        x[0] = 0
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, s = fp8_triton.quantize_rows(x.to(dev), FP8_MAX)
    want_q, want_s = quantize_rows(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (M, 1)
    assert torch.equal(s.cpu(), want_s)
    got, want = q.cpu().float(), want_q.float()
    differ = got != want
    if dev == "cpu":   # Triton's interpreter casts to FP8 its own way (the GPU's cvt rounds
        # to nearest even): it may land on the neighbouring FP8 value, or drop the carry
        # when a value rounds up to a power of two (half of it); nothing else
        w, g = want[differ].abs(), got[differ].abs()
        carry = (w.log2() % 1 == 0) & (g == w / 2)
        neighbour = (g - w).abs() <= w * 2 ** -3
        assert (carry | neighbour).all() and differ.float().mean() < 0.2
    else:
        assert not differ.any()
