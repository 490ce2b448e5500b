"""Adapter loads sent to the engine server are read off the step thread: generation goes
on while an adapter's files are read and validated, the load is acked once registered,
and commands for that name wait behind the read, in order. A real engine behind real
ZMQ sockets (tests/support/served.py)."""
from __future__ import annotations

import pytest

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_core.v1 import engine_pb2
from tests.support.served import ServedEngine
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

# rank 256 on 16 layers of width 256: a 92 MB adapter, a read of a good fraction of a
# second on a busy 2-core machine (reads are fast now: buffers reused, hashing on
# threads), against decode steps of a few milliseconds
SPEC = TinySpec(hidden_size=256, intermediate_size=1024, num_layers=16, num_heads=4,
                num_kv_heads=2)
RANK = 256
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("reads")
    model = make_model(root / "model", SPEC)
    big = make_adapter(root / "big", model, AdapterSpec(r=RANK, lora_alpha=RANK, seed=5))
    return model, big


def config(model) -> EngineConfig:
    # few sequences and tokens per step: a short warm-up (few graphs and step shapes to
    # compile for rank 256 on CUDA)
    return EngineConfig(model=str(model), max_loras=2, max_lora_rank=RANK, num_kv_blocks=256,
                        max_num_seqs=4, max_num_batched_tokens=64)


def warmed(cfg: EngineConfig) -> Engine:
    """An engine warmed up as the server warms its own (engine/server/main.py): on CUDA
    no kernel compiles once it serves, which would stall the steps counted here."""
    eng = Engine(cfg)
    try:
        eng.warm_up()
    except BaseException:
        eng.close()
        raise
    return eng


def is_ack(command_id):
    return lambda m: m.WhichOneof("kind") == "adapter_ack" and \
        m.adapter_ack.command_id == command_id


def steps_for(msgs, request_id) -> int:
    return sum(1 for _, m in msgs if m.WhichOneof("kind") == "step_batch"
               and any(d.request_id == request_id for d in m.step_batch.deltas))


def test_generation_goes_on_while_a_large_adapter_is_read(files):
    model, big = files
    with warmed(config(model)) as eng, ServedEngine(eng) as served:
        served.generate("base", [5, 6, 7], max_tokens=1000)
        served.collect(lambda m: m.WhichOneof("kind") == "step_batch")
        served.command("load-big", "load", "big", str(big))
        during = served.collect(is_ack("load-big"))
        ack = during[-1][1].adapter_ack
        assert ack.ok, ack.message
        # the base request kept decoding while the adapter was read and validated
        assert steps_for(during, "base") >= 5, steps_for(during, "base")
        served.generate("with-big", [5, 6, 7], max_tokens=6, adapter="big")
        done = served.collect(lambda m: m.WhichOneof("kind") == "step_batch" and any(
            d.request_id == "with-big" and d.finished for d in m.step_batch.deltas))
    got = [t for _, m in done if m.WhichOneof("kind") == "step_batch"
           for d in m.step_batch.deltas if d.request_id == "with-big" for t in d.token_ids]
    with Engine(config(model)) as offline:
        offline.add_adapter("big", big)
        want = offline.generate([[5, 6, 7]], SamplingParams(
            temperature=0.0, max_tokens=6, ignore_eos=True), adapters=["big"])[0].token_ids
    assert got == want


def test_commands_for_a_name_wait_behind_its_read_in_order(files, tmp_path):
    model, big = files
    with Engine(config(model)) as eng, ServedEngine(eng) as served:
        served.command("load", "load", "big", str(big))
        served.command("pin", "pin", "big")
        served.command("unload", "unload", "big")
        served.command("missing", "load", "gone", str(tmp_path / "nothing-here"))
        msgs = served.collect(is_ack("unload"))
        acks = [m.adapter_ack for _, m in msgs if m.WhichOneof("kind") == "adapter_ack"]
        by_id = {a.command_id: a for a in acks}
        order = [a.command_id for a in acks if a.command_id in ("load", "pin", "unload")]
        assert order == ["load", "pin", "unload"], order
        assert by_id["load"].ok and by_id["pin"].ok and by_id["unload"].ok
        assert by_id["load"].adapter_id == by_id["pin"].adapter_id == by_id["unload"].adapter_id
        if "missing" not in by_id:
            by_id["missing"] = served.collect(is_ack("missing"))[-1][1].adapter_ack
        assert not by_id["missing"].ok
        assert by_id["missing"].code == engine_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert eng.registry.current("big") is None and eng.registry.current("gone") is None


def test_rank_over_the_default_limit_is_refused_naming_the_flag(llama_family):
    """max_lora_rank defaults to 16: a rank-32 adapter gets INVALID_ARGUMENT that says
    which flag raises the limit, and nothing is registered."""
    with Engine(EngineConfig(model=str(llama_family.model_dir))) as eng, \
            ServedEngine(eng) as served:
        assert eng.config.max_lora_rank == 16
        served.command("r32", "load", "wide", str(llama_family.adapters["attn32"]))
        ack = served.collect(is_ack("r32"))[-1][1].adapter_ack
        assert not ack.ok and ack.code == engine_pb2.ERROR_CODE_INVALID_ARGUMENT
        assert "r=32 exceeds max_lora_rank=16" in ack.message, ack.message
        assert "--max-lora-rank" in ack.message, ack.message
        assert eng.registry.current("wide") is None
