"""LoRA on lm_head and embed_tokens (PEFT target_modules naming them), against
transformers + PEFT, greedy float32 on the CPU, token for token: in a mixed batch with
ordinary attention/MLP LoRA and base requests, on a model with its own lm_head and on one
with tied embeddings (the base weight is shared; each end's LoRA delta is its own)."""
import pytest

from tests.conftest import HFOracle, TinyFamily
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model
from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = {
    "head": AdapterSpec(r=8, lora_alpha=16, target_modules=("q_proj", "v_proj", "lm_head"),
                        seed=41),
    "embed": AdapterSpec(r=4, lora_alpha=8, target_modules=("embed_tokens", "o_proj", "down_proj"),
                         seed=42),
    "both": AdapterSpec(r=8, lora_alpha=8, use_rslora=True, seed=43,
                        target_modules=ALL + ("lm_head", "embed_tokens")),
    "attn": AdapterSpec(r=16, lora_alpha=16, target_modules=("q_proj", "k_proj", "v_proj", "o_proj"),
                        seed=44),
}
LENGTHS = [9, 1, 17, 40, 5, 12, 3, 23, 8]
ADAPTERS = ["head", None, "embed", "both", "attn", "head", None, "both", "embed"]


@pytest.fixture(scope="module", params=["own_head", "tied"])
def setup(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    spec = TinySpec(tie_word_embeddings=request.param == "tied", seed=45)
    model_dir = make_model(root / "model", spec)
    adapters = {name: make_adapter(root / name, model_dir, s) for name, s in SPECS.items()}
    family = TinyFamily("llama", model_dir, adapters)
    return family, HFOracle(family), make_engine(family)


def test_mixed_batch_matches_peft(setup):
    family, oracle, eng = setup
    prompts = prompts_of(LENGTHS, seed=9)
    refs = oracle.generate(prompts, ADAPTERS, MAX_NEW)
    outs = eng.generate(prompts, GREEDY, ADAPTERS)
    assert_matches(outs, refs)
    assert eng.lora_pool.end_weights("lm_head") is not None
    assert eng.lora_pool.end_weights("embed_tokens") is not None


def test_end_deltas_matter(setup):
    """Dropping the lm_head / embed_tokens factors changes the tokens: the ends' LoRA is
    really applied (compared with PEFT running the adapter without them)."""
    family, oracle, eng = setup
    prompts = prompts_of([20, 30, 11], seed=10)
    names = ["head", "embed", "both"]
    with_ends = [o.token_ids for o in eng.generate(prompts, GREEDY, names)]
    for i, name in enumerate(names):
        ref = oracle.generate([prompts[i]], [name], MAX_NEW)[0][0]
        assert with_ends[i] == ref
    assert with_ends != [o.token_ids for o in eng.generate(prompts, GREEDY, ["attn"] * 3)]
