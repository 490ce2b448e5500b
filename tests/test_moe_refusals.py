"""Expert LoRA adapters (PEFT `target_parameters` on Qwen2-MoE's fused experts) the
engine must refuse, each with an AdapterError naming the feature and the file, from both
validate_lora and load_lora; and model configs the MoE path cannot run exactly."""
import json
import shutil

import pytest

from loramux_core.model.hf_config import ModelConfig
from loramux_core.errors import ModelLoadError
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model
from tests.test_lora_refusals import CONFIG, WEIGHTS, edit_config, edit_tensors, refused

MAX_RANK = 16
EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
L0 = "base_model.model.model.layers.0.mlp.experts"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_refusals")
    model_dir = make_model(root / "model", TinySpec(arch="qwen2_moe", num_layers=1, seed=60))
    good = make_adapter(root / "good", model_dir, AdapterSpec(
        r=4, target_modules=("q_proj",), target_parameters=EXPERTS, seed=61))
    return ModelConfig.from_dir(model_dir), model_dir, good


@pytest.fixture
def adapter(base, tmp_path):
    return shutil.copytree(base[2], tmp_path / "adapter")


def test_good_adapter_loads(base, adapter):
    from loramux_engine.lora import load_lora
    weights = load_lora(adapter, base[0], MAX_RANK)
    assert set(weights.experts) == {(0, "gate_up_proj"), (0, "down_proj")}
    a, b = weights.experts[(0, "gate_up_proj")]
    assert a.shape == (8, 4, 64) and b.shape == (8, 64, 4)


def test_unknown_parameter(base, adapter):
    edit_config(adapter, target_parameters=["mlp.experts.w3"])
    assert "mlp.experts.w3" in refused(base[0], adapter, "target_parameters", CONFIG)


def test_missing_factor(base, adapter):
    edit_tensors(adapter, lambda t: t.pop(f"{L0}.base_layer.lora_B.weight"))
    assert "gate_up_proj" in refused(base[0], adapter, "missing_tensor", WEIGHTS)


def test_untargeted_factor(base, adapter):
    """Only down_proj targeted: the gate_up factors (one level deeper) are not placeable."""
    edit_config(adapter, target_parameters=["mlp.experts.down_proj"])
    refused(base[0], adapter, "tensor", WEIGHTS)


def test_wrong_rank(base, adapter):
    edit_config(adapter, rank_pattern={"down_proj": 2})
    assert "rank 2" in refused(base[0], adapter, "shape", WEIGHTS)


def test_non_finite_values(base, adapter):
    def poison(t):
        t[f"{L0}.lora_A.weight"][3, 5] = float("nan")
    edit_tensors(adapter, poison)
    refused(base[0], adapter, "non_finite", WEIGHTS, header_only=False)


@pytest.mark.parametrize("field,value", [("layers_to_transform", [0]),
                                         ("exclude_modules", ["q_proj"]),
                                         ("use_dora", True)])
def test_unsupported_beside_parameters(base, adapter, field, value):
    edit_config(adapter, **{field: value})
    refused(base[0], adapter, field, CONFIG)


@pytest.mark.parametrize("change", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2},
                                    {"num_experts_per_tok": 9}, {"moe_intermediate_size": 0}])
def test_model_configs_refused(base, tmp_path, change):
    raw = json.loads((base[1] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
    with pytest.raises(ModelLoadError) as ei:
        ModelConfig.from_dir(tmp_path)
    assert next(iter(change)) in str(ei.value)


def test_per_expert_module_lora_refused(base, adapter):
    """LoRA saved per expert module (transformers 4's layout, `experts.3.gate_proj`) does
    not fit the fused experts: refused by name, never half applied."""
    import torch

    edit_tensors(adapter, lambda t: t.update({
        "base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight":
            torch.ones(4, 64)}))
    assert "experts.3.gate_proj" in refused(base[0], adapter, "tensor", WEIGHTS)
