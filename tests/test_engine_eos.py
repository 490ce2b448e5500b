"""Finishing on EOS: the engine stops where Hugging Face + PEFT's greedy generate stops.

The tiny random models rarely emit their EOS id on their own, so each test makes a copy of
the model directory whose generation_config.json names as EOS a token the model (or the
adapter) is known to emit greedily mid-sequence; both the engine and HF read it from there.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from loramux_engine import Engine, EngineConfig, SamplingParams
from tests.support.tiny import load_hf_model

PROMPT = [5, 17, 40, 99, 3, 61]


def _greedy_hf(model_dir, prompt, n, adapter_dir=None, eos=None):
    model = load_hf_model(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, adapter_dir).eval()
    kwargs = {"eos_token_id": eos} if eos is not None else {"eos_token_id": None}
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n,
                             do_sample=False, pad_token_id=2, **kwargs)
    return out[0, len(prompt):].tolist()


def _with_eos(src, dst, eos_id):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "generation_config.json").read_text())
    cfg["eos_token_id"] = eos_id
    (dst / "generation_config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("adapter", [None, "ap8"])
def test_finishes_on_eos_like_hf(llama_family, tmp_path, adapter):
    adapter_dir = llama_family.adapters[adapter] if adapter else None
    free_run = _greedy_hf(llama_family.model_dir, PROMPT, 12, adapter_dir)
    eos_id = free_run[4]
    first = free_run.index(eos_id)  # EOS may already appear before position 4
    model_dir = _with_eos(llama_family.model_dir, tmp_path / "model", eos_id)
    expected = _greedy_hf(model_dir, PROMPT, 12, adapter_dir, eos=eos_id)
    assert expected == free_run[:first + 1]  # HF stopped at the EOS, included it

    eng = Engine(EngineConfig(model=str(model_dir), max_loras=2, num_kv_blocks=64))
    if adapter:
        eng.add_adapter(adapter, adapter_dir)
    out = eng.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12),
                       [adapter])[0]
    assert out.token_ids == expected
    assert out.finish_reason == "eos"

    ignored = eng.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12,
                                                    ignore_eos=True), [adapter])[0]
    assert ignored.token_ids == free_run
    assert ignored.finish_reason == "length"
    eng.close()
