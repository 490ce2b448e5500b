"""Greedy float32 parity with transformers + PEFT, token for token, for the architectures
beyond Llama/Qwen2: Qwen3 (q/k norms) and Mistral with a sliding window shorter than most
prompts (and than the prefill chunk), in a mixed batch of base requests and adapters of
different ranks, through the engine (paged cache, chunked prefill, the slot pool)."""
import pytest

from tests.conftest import ADAPTER_SPECS, HFOracle, TinyFamily
from tests.support.tiny import TinySpec, make_adapter, make_model
from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of

WINDOW = 7
SPECS = {"qwen3": TinySpec(arch="qwen3", seed=21),
         "mistral_window": TinySpec(arch="mistral", sliding_window=WINDOW, seed=22)}
LENGTHS = [1, 5, 9, 17, 40, 3, 12]
ADAPTERS = ["rs4", None, "ap8", "attn32", None, "rs4", "ap8"]


@pytest.fixture(scope="module", params=list(SPECS))
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model_dir = make_model(root / "model", SPECS[request.param])
    adapters = {name: make_adapter(root / name, model_dir, spec)
                for name, spec in ADAPTER_SPECS.items()}
    family = TinyFamily(request.param, model_dir, adapters)
    return family, HFOracle(family), make_engine(family)


def test_config_is_the_architecture(setup):
    family, oracle, eng = setup
    cfg = eng.model_config
    assert cfg.qk_norm == (family.arch == "qwen3")
    assert cfg.sliding_window == (WINDOW if family.arch == "mistral_window" else None)


def test_mixed_batch(setup):
    family, oracle, eng = setup
    prompts = prompts_of(LENGTHS, seed=5)
    refs = oracle.generate(prompts, ADAPTERS, MAX_NEW)
    outs = eng.generate(prompts, GREEDY, ADAPTERS)
    assert_matches(outs, refs)
    # the adapters really change the output, or the test would not test them
    base = eng.generate(prompts, GREEDY)
    assert any(o.token_ids != b.token_ids for o, b, a in zip(outs, base, ADAPTERS) if a)
