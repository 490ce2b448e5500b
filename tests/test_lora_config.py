"""adapter_config.json matching rules against PEFT's own functions, over every module name
of a Llama-style model (no model or tensors needed); hostile patterns are matched in
linear time (RE2) or refused."""
from __future__ import annotations

import json
import time

import pytest
from peft import LoraConfig
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key

from loramux_core.adapter.config import parse_adapter_config, read_adapter_config
from loramux_core.model.archs.llama import DECODER_TARGETS
from loramux_core.errors import AdapterError

LORA_TARGETS = [t.module for t in DECODER_TARGETS]
NAMES = [f"model.layers.{i}.{t.parent}.{t.module}"
         for i in range(12) for t in DECODER_TARGETS] + \
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
    # target_modules / exclude_modules as written by common training recipes
    dict(target_modules=r".*\.(q_proj|k_proj|v_proj|o_proj)$"),
    dict(target_modules=r"model\.layers\.\d+\.(self_attn|mlp)\.\w+_proj"),
    dict(target_modules=r"(?:.*\.)?(?:gate|up|down)_proj"),
    dict(target_modules=r".*(self_attn|mlp)\.(q|k|v|o|gate|up|down)_proj"),
    dict(target_modules=r".*layers\.(0|1|2|10)\.self_attn\.[qv]_proj"),
    dict(target_modules=r"^(?!.*lm_head).*proj$"),      # lookaround: refused, see below
    dict(target_modules=r"(?i).*Q_PROJ"),
    dict(target_modules=["q_proj", "v_proj"], exclude_modules=["layers.3.self_attn.q_proj"]),
    dict(target_modules=r".*_proj", exclude_modules=r".*\.(?:1[0-1]|[02468])\.mlp\..*"),
    dict(target_modules=["layers.1.mlp.down_proj", "model.layers.11.self_attn.v_proj"]),
]
NOT_RE2 = {r"^(?!.*lm_head).*proj$"}


def write_config(tmp_path, **fields):
    cfg = LoraConfig(r=8, lora_alpha=16, **fields)
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg.to_dict(), default=list))
    return cfg, read_adapter_config(tmp_path, max_lora_rank=64)


@pytest.mark.parametrize("fields", CASES, ids=range(len(CASES)))
def test_targets_match_peft(tmp_path, fields):
    if str(fields["target_modules"]) in NOT_RE2:
        with pytest.raises(AdapterError, match="linear time"):
            write_config(tmp_path, **fields)
        return
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


def test_real_world_rank_and_alpha_patterns_match_peft(tmp_path):
    """Per-layer patterns as produced by rank-allocating tools (one key per module,
    full names and suffixes mixed, regex groups and classes)."""
    rank_pattern = {f"model.layers.{i}.self_attn.{m}": 1 + (i * 3 + k) % 16
                    for i in range(0, 12, 2) for k, m in enumerate(("q_proj", "v_proj"))}
    rank_pattern.update({r"layers\.(1|3|5)\.mlp\.(gate|up)_proj": 12, r"\w+\.down_proj": 6})
    alpha_pattern = {r"model\.layers\.[0-4]\..*": 7, r"self_attn\.[kv]_proj": 9.5}
    peft_cfg, ours = write_config(tmp_path, target_modules=list(LORA_TARGETS),
                                  rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)
    for name in NAMES[:-3]:
        r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), peft_cfg.r)
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), name), peft_cfg.lora_alpha)
        assert ours.rank_of(name) == r, name
        assert ours.scaling_of(name) == pytest.approx(alpha / r, rel=1e-12), name


HOSTILE = [r"(a+)+$", r"(.*a){20}", r"(x+x+)+y", r"(\w|\w\w)*\d", r"((a|aa)+)+b",
           r"(.*\.)*(.*\.)*(.*\.)*(.*\.)*(.*\.)*z"]


@pytest.mark.parametrize("field", ["target_modules", "exclude_modules", "rank_pattern",
                                   "alpha_pattern"])
@pytest.mark.parametrize("pattern", HOSTILE, ids=range(len(HOSTILE)))
def test_catastrophic_patterns_match_in_linear_time(field, pattern):
    """Python's re takes exponential time on these against long names; RE2 does not."""
    raw = {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]}
    raw[field] = {pattern: 4} if field.endswith("pattern") else pattern
    cfg = parse_adapter_config(json.dumps(raw).encode(), 64, "adapter_config.json")
    long_names = ["a" * 5000 + "!", "model." + "a." * 3000 + "x" * 2000, "w" * 5000 + "_"]
    t0 = time.monotonic()
    for name in long_names:
        cfg.targets(name), cfg.rank_of(name), cfg.scaling_of(name)
    assert time.monotonic() - t0 < 10.0  # 0.05 s under load; Python's re: hours


@pytest.mark.parametrize("pattern, why", [
    (r"(a)\1", "linear time"), (r"(?<=x)q_proj", "linear time"), (r"(?=q)q_proj", "linear time"),
    (r"(unclosed", "not a valid regex"), (r"(a{1000}){1000}", "linear time"),
    ("x" * 20000, "longer than")])
def test_patterns_refused(pattern, why):
    for field in ("target_modules", "exclude_modules", "rank_pattern"):
        raw = {"r": 8, "target_modules": ["q_proj"]}
        raw[field] = {pattern: 4} if field == "rank_pattern" else pattern
        with pytest.raises(AdapterError) as ei:
            parse_adapter_config(json.dumps(raw).encode(), 64, "adapter_config.json")
        assert why in str(ei.value) and ei.value.feature == field, str(ei.value)


def test_too_many_pattern_keys_refused():
    raw = {"r": 8, "target_modules": ["q_proj"], "rank_pattern": {f"k{i}": 4 for i in range(2000)}}
    with pytest.raises(AdapterError, match="keys"):
        parse_adapter_config(json.dumps(raw).encode(), 64, "adapter_config.json")
