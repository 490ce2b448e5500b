"""The warm-up's eager steps run a slice of the decoder layers (engine/warmup_layers.py):
the first layer and one layer standing for the rest. On a model deeper than the slice,
the kernel variants whole-model traffic launches after such a warm-up are all ones the
warm-up launched (the launch keys of tests/test_warmup.py), each eager step ran only the
slice, and the model has all its layers back afterwards; warming the first layer alone
is not enough (its input norm adds no residual), which the same check sees."""
import pytest

from loramux_engine.model.llama import LlamaForCausalLM
from loramux_engine.warmup_layers import only_layers, representative_layers
from tests.conftest import ADAPTER_SPECS, TinyFamily
from tests.support.tiny import TinySpec, make_adapter, make_model
from tests.test_warmup import SMALL, cpu_model, run_traffic, warmed_engine


@pytest.fixture(scope="module")
def deep_family(tmp_path_factory) -> TinyFamily:
    root = tmp_path_factory.mktemp("warmup_deep")
    model = make_model(root / "model", TinySpec(num_layers=5, seed=23))
    return TinyFamily("llama_deep", model, {
        name: make_adapter(root / name, model, spec) for name, spec in ADAPTER_SPECS.items()})


class LayerCalls:
    """How many decoder layers each forward pass of the model ran."""

    def __init__(self, monkeypatch):
        self.depths: list[int] = []
        forward = LlamaForCausalLM.forward

        def counted(this, input_ids, attn, kv_caches, lora=None):
            self.depths.append(len(this.layers))
            return forward(this, input_ids, attn, kv_caches, lora)
        monkeypatch.setattr(LlamaForCausalLM, "forward", counted)


@cpu_model
def test_a_slice_of_layers_warms_what_every_layer_launches(deep_family, monkeypatch):
    calls = LayerCalls(monkeypatch)
    eng, keys = warmed_engine(deep_family, monkeypatch, SMALL)
    warmed = len(calls.depths)
    assert representative_layers(eng.runner) == [0, 1]
    assert warmed and set(calls.depths) == {2}, "eager warm-up steps ran more than the slice"
    assert len(eng.runner.model.layers) == len(eng.runner.kv_caches) == 5
    warm = set(keys.keys)
    run_traffic(eng, SMALL, seed=7)
    assert set(calls.depths[warmed:]) == {5}, "traffic ran the whole model"
    new = keys.keys - warm
    assert not new, f"{len(new)} kernel variants first launched after warm-up: {sorted(new)[:3]}"


@cpu_model
def test_warming_the_first_layer_alone_is_caught(deep_family, monkeypatch):
    monkeypatch.setattr("loramux_engine.warmup.representative_layers", lambda runner: [0])
    eng, keys = warmed_engine(deep_family, monkeypatch, SMALL)
    warm = set(keys.keys)
    run_traffic(eng, SMALL, seed=7)
    assert {name for name, _ in keys.keys - warm} == {"add_rms_norm_shrink_kernel"}


@pytest.mark.engine_device("cpu")
def test_only_layers_restores_the_model_on_error(deep_family):
    from tests.test_lifecycle_tiers import make_engine
    eng = make_engine(deep_family, [])
    full, caches = eng.runner.model.layers, eng.runner.kv_caches
    with pytest.raises(RuntimeError), only_layers(eng.runner, [0, 3]):
        assert [layer.layer_idx for layer in eng.runner.model.layers] == [0, 3]
        assert eng.runner.kv_caches == [caches[0], caches[3]]
        raise RuntimeError("a failed step")
    assert eng.runner.model.layers is full and eng.runner.kv_caches is caches
