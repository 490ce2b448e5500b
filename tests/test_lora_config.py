"""adapter_config.json matching rules against PEFT's own functions, over every module name
of a Llama-style model (no model or tensors needed)."""
from __future__ import annotations

import json

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from engine.lora.config import read_adapter_config
from engine.lora.plan import module_name
from engine.model.lora_targets import LORA_TARGETS

NAMES = [module_name(i, m) for i in range(12) for m in LORA_TARGETS] + \
    ["lm_head", "model.embed_tokens", "model.layers.3.input_layernorm"]

CASES = [
    dict(target_modules=["q_proj", "v_proj"]),
    dict(target_modules=["self_attn.o_proj", "mlp.down_proj"]),
    dict(target_modules=["model.layers.2.mlp.up_proj", "k_proj"]),
    dict(target_modules=r".*layers\.1[01]?\.(self_attn\.(q|k)_proj|mlp\.gate_proj)"),
    dict(target_modules=["q_proj", "gate_proj"], layers_to_transform=[0, 3, 11]),
    dict(target_modules=["o_proj"], layers_to_transform=4, layers_pattern="layers"),
    dict(target_modules=["q_proj", "k_proj", "down_proj"], exclude_modules=["k_proj"]),
    dict(target_modules=["q_proj", "down_proj"], exclude_modules=r".*layers\.[2-5]\..*"),
]


def write_config(tmp_path, **fields):
    cfg = LoraConfig(r=8, lora_alpha=16, **fields)
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg.to_dict(), default=list))
    return cfg, read_adapter_config(tmp_path, max_lora_rank=64)


@pytest.mark.parametrize("fields", CASES, ids=range(len(CASES)))
def test_targets_match_peft(tmp_path, fields):
    peft_cfg, ours = write_config(tmp_path, **fields)
    for name in NAMES:
        want = check_target_module_exists(peft_cfg, name)
        want = bool(want) and type(want).__name__ != "_ExcludedModule"
        assert ours.targets(name) == want, name


def test_rank_and_alpha_patterns_match_peft(tmp_path):
    rank_pattern = {r"layers\.1\.self_attn\.q_proj": 4, "q_proj": 16, r"mlp\.(up|down)_proj": 2,
                    r"layers\.1[0-9]\..*": 32}
    alpha_pattern = {"v_proj": 64, r"model\.layers\.0\.self_attn\.o_proj": 3, "proj": 5}
    peft_cfg, ours = write_config(tmp_path, target_modules=list(LORA_TARGETS),
                                  rank_pattern=rank_pattern, alpha_pattern=alpha_pattern,
                                  use_rslora=True)
    seen = set()
    for name in NAMES[:-3]:
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), peft_cfg.r)
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), name), peft_cfg.lora_alpha)
        assert ours.rank_of(name) == r, name
        assert ours.scaling_of(name) == pytest.approx(alpha / r ** 0.5, rel=1e-12), name
        seen.add((r, alpha))
    assert len(seen) > 5  # the patterns really select different values


def test_all_linear_excludes_head_and_embedding(tmp_path):
    _, ours = write_config(tmp_path, target_modules="all-linear")
    assert ours.is_all_linear
    assert all(ours.targets(n) for n in NAMES[:-3])
    assert not ours.targets("lm_head") and not ours.targets("model.embed_tokens")
