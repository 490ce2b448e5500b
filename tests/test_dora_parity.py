"""DoRA adapters (`use_dora: true`) against PEFT, greedy float32 on the CPU, token for
token: each DoRA slot's per-row magnitude factor is applied to its own tokens only, in a
mixed batch with plain LoRA adapters and base requests. PEFT itself refuses mixed batches
of DoRA adapters, so each request's reference runs alone with only its adapter active.
Also: DoRA is refused clearly by a pool that cannot serve it (without the base weights
or, on row-parallel groups under tensor parallelism, without the ranks' all-reduce). The
kernel path (CUDA's): tests/test_kernel_path_extras.py, tests/test_cuda_graphs.py."""
import pytest
import torch

from loramux_engine.lora import LoRASlotPool, load_lora
from loramux_core.adapter.plan import plan_adapter
from loramux_engine.lora.weights import weights_from_plan
from loramux_engine.parallel import TPGroup
from loramux_core.errors import AdapterError
from tests.conftest import ADAPTER_SPECS, HFOracle, TinyFamily
from tests.support.tiny import AdapterSpec, make_adapter, read_json
from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of

DORA_SPECS = {
    "dora8": AdapterSpec(r=8, lora_alpha=16, seed=31),
    "dora_attn": AdapterSpec(r=4, lora_alpha=8, use_rslora=True, seed=32,
                             target_modules=("q_proj", "v_proj", "o_proj"),
                             rank_pattern={"o_proj": 2}),
}
LENGTHS = [9, 1, 17, 40, 5, 12, 3, 23]
ADAPTERS = ["dora8", None, "rs4", "dora_attn", "ap8", "dora8", None, "dora_attn"]


@pytest.fixture(scope="module")
def family(llama_family, tmp_path_factory):
    root = tmp_path_factory.mktemp("dora")
    dora = {name: make_adapter(root / name, llama_family.model_dir, spec, use_dora=True)
            for name, spec in DORA_SPECS.items()}
    plain = {name: llama_family.adapters[name] for name in ("rs4", "ap8")}
    return TinyFamily("llama", llama_family.model_dir, {**plain, **dora})


@pytest.fixture(scope="module")
def engine(family):
    return make_engine(family)


def test_adapter_files_are_dora(family):
    for name in DORA_SPECS:
        assert read_json(family.adapters[name] / "adapter_config.json")["use_dora"] is True


def test_mixed_batch_matches_peft(family, engine):
    prompts = prompts_of(LENGTHS, seed=7)
    refs = HFOracle(family).generate_each(prompts, ADAPTERS, MAX_NEW)
    outs = engine.generate(prompts, GREEDY, ADAPTERS)
    assert_matches(outs, refs)
    assert engine.lora_pool.dora_slots  # the DoRA path really ran


def test_magnitude_matters(family, engine, tmp_path):
    """The same factors without the magnitude (plain LoRA) give other tokens: the DoRA
    factor is really applied."""
    prompts = prompts_of([20, 30], seed=8)
    dora = engine.generate(prompts, GREEDY, ["dora8", "dora8"])
    plain = HFOracle(TinyFamily("llama", family.model_dir, {"dora8": _without_dora(
        family.adapters["dora8"], tmp_path)})).generate(prompts, ["dora8", "dora8"], MAX_NEW)
    assert [o.token_ids for o in dora] != [toks for toks, _ in plain]


def _without_dora(src, dst):
    from safetensors.torch import load_file, save_file
    from tests.support.tiny import write_json

    dst.mkdir(exist_ok=True)
    tensors = {k: v for k, v in load_file(src / "adapter_model.safetensors").items()
               if "magnitude" not in k}
    save_file(tensors, dst / "adapter_model.safetensors")
    write_json(dst / "adapter_config.json",
               {**read_json(src / "adapter_config.json"), "use_dora": False})
    return dst


def test_refused_where_not_served(family, engine):
    cfg = engine.model_config
    one = load_lora(family.adapters["dora8"], cfg, 64)
    assert one.use_dora
    pool = LoRASlotPool(cfg, 2, 64)  # no base weights to take row norms of
    with pytest.raises(AdapterError) as err:
        pool.load(0, one)
    assert err.value.feature == "use_dora"
    assert not pool.dora_slots and not torch.any(pool.weights(0, "qkv")[2])
    # at TP=2, DoRA on row-parallel groups needs the ranks' all-reduce (served with it:
    # tests/test_moe_tp.py)
    two = weights_from_plan(plan_adapter(family.adapters["dora8"], cfg, 64), cfg,
                            TPGroup(rank=0, size=2))
    pool = LoRASlotPool(cfg, 2, 64, tp_size=2, base_weight=lambda *key: None)
    with pytest.raises(AdapterError) as err:
        pool.load(0, two)
    assert err.value.feature == "use_dora" and not pool.dora_slots


def test_factors_in_row_chunks(monkeypatch):
    """The row norms are taken CHUNK_ROWS rows of W + B·A at a time (a bounded temporary
    on the device): any chunking gives m / ||W + B·A|| per row, for whole rows and for the
    ranks' partial sums of squares alike."""
    from types import SimpleNamespace

    from loramux_engine.lora import dora
    g = torch.Generator().manual_seed(4)
    widths, K, R = (7, 5), 6, 3
    N = sum(widths)
    gw = SimpleNamespace(a=torch.randn(2, R, K, generator=g), b=torch.randn(N, R, generator=g),
                         magnitude=torch.rand(N, generator=g) + 0.5, slice_ranks=(3, 2))
    gw.b[widths[0]:, 2:] = 0
    gw.a[1, 2:] = 0
    base, shape = torch.randn(N, K, generator=g), SimpleNamespace(out_features=widths)
    full = torch.cat([base[:7] + gw.b[:7] @ gw.a[0], base[7:] + gw.b[7:] @ gw.a[1]])
    want = gw.magnitude / torch.linalg.norm(full, dim=1)
    for chunk in (2048, 3, 1):
        monkeypatch.setattr(dora, "CHUNK_ROWS", chunk)
        out = torch.zeros(N)
        dora.write_factors(out, gw, base, shape)
        torch.testing.assert_close(out, want)
        pending, scales = dora.PendingNorms(), {"k": torch.ones(2, N)}
        pending.add(1, "k", gw, base, shape)
        pending.settle(lambda t: t, scales)
        torch.testing.assert_close(scales["k"][1], want)


def test_settle_is_ordered_after_the_loads_stream(monkeypatch):
    """At TP > 1 rank 0 loads a slot on the copier's side stream, which computes the
    row-parallel groups' partial norms there; `settle` reads them on the stream of the
    next step that reads LoRA, which waits only for the copies of the adapters it runs
    (not this one: its requests run a step later at the earliest). On recorded streams
    (tests/support/fake_cuda.py): the all-reduce must come after every partial the load
    made, through an event the settling stream waited on."""
    from types import SimpleNamespace

    from loramux_engine.lora import dora
    from tests.support import fake_cuda
    cuda = fake_cuda.install(monkeypatch)
    made = []   # (stream, position) of each partial norm computed
    sq_norms = dora._sq_norms

    def marked(*args):
        out = sq_norms(*args)
        made.append((cuda.current, cuda.current.mark("partial norms")))
        return out

    monkeypatch.setattr(dora, "_sq_norms", marked)
    g = torch.Generator().manual_seed(5)
    N, K, R = 6, 4, 2
    gw = SimpleNamespace(a=torch.randn(1, R, K, generator=g), b=torch.randn(N, R, generator=g),
                         magnitude=torch.rand(N, generator=g) + 0.5, slice_ranks=(R,))
    base, shape = torch.randn(N, K, generator=g), SimpleNamespace(out_features=(N,))
    pending = dora.PendingNorms(torch.device("cuda"))
    compute, side = cuda.current, torch.cuda.Stream()
    with torch.cuda.stream(side):   # the slot load
        pending.add(1, ("layer", "o"), gw, base, shape)

    def all_reduce(t):
        assert made and all(cuda.covered(compute, s, pos) for s, pos in made), (
            "settle reads the partial norms before the load's stream has made them")
        return t

    scales = {("layer", "o"): torch.ones(3, N)}
    pending.settle(all_reduce, scales)
    want = gw.magnitude / torch.linalg.norm(base + gw.b @ gw.a[0], dim=1)
    torch.testing.assert_close(scales[("layer", "o")][1], want)
    assert cuda.syncs == []   # ordered on the device, not by a host wait


def test_no_device_memory_for_the_extras_refuses_the_adapter(family, monkeypatch, tmp_path):
    """DoRA's factor tables and an end target's buffers are allocated at the first adapter
    that needs them, when it is read: a device without room refuses that adapter there
    (AdapterError naming the memory), and the engine serves on, plain adapters and base
    requests alike, and the same DoRA adapter once there is room."""
    from loramux_engine.lora.dora import DoraFactors
    from loramux_engine.lora.end_slots import EndSlots
    from tests.test_end_lora_parity import SPECS as END_SPECS

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
    head = make_adapter(tmp_path / "head", family.model_dir, END_SPECS["head"])
    eng = make_engine(TinyFamily("llama", family.model_dir, {"rs4": family.adapters["rs4"]}))
    try:
        with monkeypatch.context() as mp:
            mp.setattr(DoraFactors, "allocate", no_room)
            mp.setattr(EndSlots, "allocate", no_room)
            for name, path, what in (("dora8", family.adapters["dora8"], "DoRA factors"),
                                     ("head", head, "LoRA on lm_head")):
                with pytest.raises(AdapterError) as err:
                    eng.add_adapter(name, path)
                assert err.value.feature == "device_memory" and what in str(err.value)
            prompts = prompts_of([6, 9], seed=3)
            outs = eng.generate(prompts, GREEDY, ["rs4", None])
            assert all(len(o.token_ids) > 0 for o in outs)
        assert not eng.lora_pool.dora_slots and eng.lora_pool.dora_scale(0, "qkv") is None
        eng.add_adapter("dora8", family.adapters["dora8"])
        ref = HFOracle(TinyFamily("llama", family.model_dir,
                                  {"dora8": family.adapters["dora8"]})).generate_each(
            prompts[:1], ["dora8"], MAX_NEW)
        assert_matches(eng.generate(prompts[:1], GREEDY, ["dora8"]), ref)
    finally:
        eng.close()
