import pytest
from tests.test_engine_parity import make_engine, prompts_of, GREEDY
from tests.support.kernel_path import lora_kernel_path
from engine import SamplingParams


@pytest.mark.parametrize("fuse", ["off", "all"])
@pytest.mark.parametrize("name", ["attn32", "rs4", "ap8"])
def test_uniform(llama_family, llama_oracle, monkeypatch, fuse, name):
    from engine.lora import batch as batch_module
    from kernels import lora as lora_kernels
    from kernels import lora_triton
    for n in ("norm_shrink_ahead", "silu_shrink_ahead"):
        monkeypatch.setattr(lora_kernels, n, getattr(lora_triton, n))
    monkeypatch.setattr(batch_module, "FUSED_NORM_SHRINK", fuse)
    monkeypatch.setattr(batch_module, "FUSED_SILU_SHRINK", fuse)
    prompt = prompts_of([30], seed=10)[0]
    ref = llama_oracle.generate([prompt], [name], 6)[0][0]
    with lora_kernel_path():
        eng = make_engine(llama_family, block_size=8)
        (out,) = eng.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, logprobs=True), [name])
    assert out.token_ids == ref
