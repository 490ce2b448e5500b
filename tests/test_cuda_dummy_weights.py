"""load_format="dummy" (random weights, no weight files: for full-size benchmarks) on the
CPU; the bf16 CUDA run is in tests/test_cuda_graphs.py."""
import shutil

import pytest
import torch

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_core.errors import InvalidRequestError


def test_dummy_needs_no_weight_files(llama_family, tmp_path):
    for f in llama_family.model_dir.iterdir():   # config and tokenizer only
        if f.suffix != ".safetensors" and f.is_file():
            shutil.copy(f, tmp_path / f.name)
    eng = Engine(EngineConfig(model=str(tmp_path), load_format="dummy", seed=3,
                              num_kv_blocks=64, enforce_eager=True))
    params = dict(eng.model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    w = params["layers.0.self_attn.qkv_proj.weight"]
    assert w.std().item() == pytest.approx(w.shape[1] ** -0.5, rel=0.2)
    assert torch.equal(params["norm.weight"], torch.ones_like(params["norm.weight"]))
    out = eng.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4, logprobs=True))
    assert len(out[0].token_ids) == 4 and all(lp == lp for lp in out[0].logprobs)
    again = Engine(EngineConfig(model=str(tmp_path), load_format="dummy", seed=3,
                                num_kv_blocks=64))
    assert torch.equal(dict(again.model.named_parameters())["layers.0.self_attn.qkv_proj.weight"], w)


def test_unknown_load_format_refused(llama_family):
    with pytest.raises(InvalidRequestError, match="load_format='npz'"):
        EngineConfig(model=str(llama_family.model_dir), load_format="npz")
