"""The new LoRA targets across two tensor-parallel ranks (gloo on the CPU) against
transformers + PEFT, greedy float32, token for token: Qwen2-MoE with its experts split
along their intermediate dim, in one mixed batch of base requests, expert LoRA (PEFT
`target_parameters`, beside attention and shared-expert LoRA), lm_head LoRA, embed_tokens
LoRA and DoRA (on column-parallel modules, whose rows are whole on a rank, and on
row-parallel ones, whose row norms are summed across the ranks)."""
import pytest

from loramux_engine import Engine, EngineConfig
from tests.conftest import TinyFamily
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model
from tests.test_engine_parity import GREEDY, assert_matches, prompts_of
from tests.test_moe_parity import EXPERTS, _oracle_each

SPECS = {
    "moe": (AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "o_proj", "up_proj",
                                                            "down_proj"),
                        target_parameters=EXPERTS, seed=71), {}),
    "moe_gate_up": (AdapterSpec(r=8, lora_alpha=8, target_modules=(), seed=72,
                                target_parameters=("gate_up_proj",), use_rslora=True), {}),
    "ends": (AdapterSpec(r=8, lora_alpha=16, target_modules=("v_proj", "lm_head",
                                                              "embed_tokens"), seed=73), {}),
    "dora_cols": (AdapterSpec(r=4, lora_alpha=8, target_modules=("q_proj", "k_proj", "v_proj",
                                                                  "gate_proj", "up_proj"),
                              seed=74), {"use_dora": True}),
    "dora_rows": (AdapterSpec(r=4, lora_alpha=8, target_modules=("v_proj", "o_proj",
                                                                  "down_proj"), seed=75),
                  {"use_dora": True}),
}
LENGTHS = [9, 1, 17, 30, 5, 12, 23, 8, 14]
ADAPTERS = ["moe", None, "ends", "moe_gate_up", "dora_cols", "dora_rows", "ends",
            "dora_rows", "moe"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_tp")
    model_dir = make_model(root / "model", TinySpec(arch="qwen2_moe", seed=70))
    adapters = {name: make_adapter(root / name, model_dir, spec, **extra)
                for name, (spec, extra) in SPECS.items()}
    return TinyFamily("qwen2_moe", model_dir, adapters)


@pytest.fixture(scope="module")
def engine(family):
    eng = Engine(EngineConfig(model=str(family.model_dir), tp_size=2, device="cpu",
                              dtype="float32", max_loras=6, max_lora_rank=16, block_size=8,
                              num_kv_blocks=128, max_num_batched_tokens=32))
    try:
        for name, path in family.adapters.items():
            eng.add_adapter(name, path)
        yield eng
    finally:
        eng.close()


def test_mixed_batch_matches_peft(family, engine):
    prompts = prompts_of(LENGTHS, seed=13)
    refs = _oracle_each(family, prompts, ADAPTERS)
    assert_matches(engine.generate(prompts, GREEDY, ADAPTERS), refs)
    pool = engine.lora_pool
    assert pool.expert_slots and pool.dora_slots and pool.end_weights("embed_tokens") is not None
