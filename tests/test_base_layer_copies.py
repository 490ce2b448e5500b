"""Adapters as PEFT saves them by default: LoRA on embed_tokens and lm_head with
save_embedding_layers="auto", which writes the whole base layer beside the LoRA factors.
Served when each copy equals the base model's layer bit for bit in the copy's dtype (the
base tensor cast to it), token for token as transformers + PEFT generate; one changed
element is refused, naming the tensor, by the engine's read and through AdapterAdmin."""
from __future__ import annotations

import shutil

import pytest
import torch
from loramux import AdminClient, LoramuxError
from loramux.v1 import adapter_admin_pb2 as pb
from safetensors.torch import load_file, save_file

from loramux_engine.lora import load_lora, validate_lora
from loramux_engine.lora.base_copies import BaseLayers
from loramux_core.errors import AdapterError
from loramux_core.model.hf_config import ModelConfig
from loramux_services.launcher import Cluster, ClusterConfig
from tests.conftest import HFOracle, TinyFamily
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model
from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of

WEIGHTS = "adapter_model.safetensors"
EMBED_COPY = "base_model.model.model.embed_tokens.base_layer.weight"
HEAD_COPY = "base_model.model.lm_head.base_layer.weight"
SPEC = AdapterSpec(r=8, lora_alpha=16, seed=51,
                   target_modules=("q_proj", "v_proj", "lm_head", "embed_tokens"))
RANK = 64


@pytest.fixture(scope="module", params=["own_head", "tied"])
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model = make_model(root / "model", TinySpec(tie_word_embeddings=request.param == "tied",
                                                seed=52))
    saved = make_adapter(root / "adapters" / "saved", model, SPEC, save_embedding_layers="auto")
    return TinyFamily("llama", model, {"saved": saved})


def edited(src, dst, fn):
    """A copy of adapter directory `src` at `dst` with its tensors changed by `fn`."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / WEIGHTS)
    fn(tensors)
    save_file(tensors, dst / WEIGHTS, metadata={"format": "pt"})
    return dst


def bump(key: str):
    """Moves one element of tensor `key` to the next representable value."""
    def fn(tensors):
        t = tensors[key]
        t[3, 5] = torch.nextafter(t[3, 5], torch.tensor(float("inf"), dtype=t.dtype))
    return fn


def read(family, d):
    cfg = ModelConfig.from_dir(family.model_dir)
    return load_lora(d, cfg, RANK, base_layers=BaseLayers(family.model_dir,
                                                          cfg.tie_word_embeddings))


def test_peft_default_save_holds_both_copies(family):
    keys = set(load_file(family.adapters["saved"] / WEIGHTS))
    assert {EMBED_COPY, HEAD_COPY} <= keys


def test_served_token_for_token_as_peft(family):
    """PEFT loads the copies into its base layers; unchanged, the tokens are the base's
    with the adapter's LoRA, and the engine serves the same."""
    oracle, eng = HFOracle(family), make_engine(family)
    prompts = prompts_of([9, 17, 30, 4], seed=11)
    names = ["saved", None, "saved", "saved"]
    assert_matches(eng.generate(prompts, GREEDY, names), oracle.generate(prompts, names, MAX_NEW))
    assert eng.lora_pool.end_weights("lm_head") is not None
    assert eng.lora_pool.end_weights("embed_tokens") is not None


@pytest.mark.parametrize("key", [EMBED_COPY, HEAD_COPY])
def test_one_changed_element_is_refused_naming_the_tensor(family, tmp_path, key):
    d = edited(family.adapters["saved"], tmp_path / "changed", bump(key))
    cfg = ModelConfig.from_dir(family.model_dir)
    validate_lora(d, cfg, RANK, header_only=True)   # the header alone is fine
    with pytest.raises(AdapterError) as ei:
        read(family, d)
    assert ei.value.feature == "save_embedding_layers"
    assert key in str(ei.value) and "at 1 of 24576 elements" in str(ei.value)


def test_a_copy_of_another_shape_is_refused(family, tmp_path):
    d = edited(family.adapters["saved"], tmp_path / "resized",
               lambda t: t.update({EMBED_COPY: torch.cat([t[EMBED_COPY], t[EMBED_COPY][:2]])}))
    with pytest.raises(AdapterError) as ei:
        validate_lora(d, ModelConfig.from_dir(family.model_dir), RANK, header_only=True)
    assert EMBED_COPY in str(ei.value) and "[386, 64]" in str(ei.value)
    assert "[384, 64]" in str(ei.value)


def test_copy_in_another_dtype_is_compared_after_casting_the_base(family, tmp_path):
    """The base (float32) cast to the copy's bfloat16 as torch rounds it is accepted;
    the same values truncated instead of rounded differ, and are refused."""
    rounded = edited(family.adapters["saved"], tmp_path / "rounded",
                     lambda t: t.update({k: t[k].to(torch.bfloat16) for k in (EMBED_COPY,
                                                                             HEAD_COPY)}))
    assert "embed_tokens" in read(family, rounded).ends

    def truncate(t):
        bits = t[EMBED_COPY].view(torch.int32) >> 16
        t[EMBED_COPY] = bits.to(torch.int16).view(torch.bfloat16)
    truncated = edited(family.adapters["saved"], tmp_path / "truncated", truncate)
    with pytest.raises(AdapterError, match="differs from the base model's "
                                           "model.embed_tokens.weight at [1-9]"):
        read(family, truncated)


def test_bfloat16_base_against_a_float32_copy(tmp_path):
    """A bfloat16 checkpoint trained in float32: PEFT's copy is the exact widening."""
    model = make_model(tmp_path / "model", TinySpec(dtype="bfloat16", seed=53))
    d = make_adapter(tmp_path / "a", model, SPEC, save_embedding_layers="auto")
    assert load_file(d / WEIGHTS)[EMBED_COPY].dtype == torch.float32
    family = TinyFamily("llama", model, {"a": d})
    assert "lm_head" in read(family, d).ends
    with pytest.raises(AdapterError, match="at 1 of"):
        read(family, edited(d, tmp_path / "b", bump(HEAD_COPY)))


@pytest.mark.timeout(300)
def test_admin_load_refuses_a_changed_copy_with_invalid_argument(family, tmp_path):
    if ModelConfig.from_dir(family.model_dir).tie_word_embeddings:
        pytest.skip("one service run is enough")
    roots = family.adapters["saved"].parent
    edited(family.adapters["saved"], roots / "changed", bump(HEAD_COPY))
    cfg = ClusterConfig(model=str(family.model_dir), adapter_roots=(str(roots),),
                        workdir=str(tmp_path / "run"), env={"OMP_NUM_THREADS": "1"})
    c = Cluster(cfg)
    c.start("engine", "control")
    try:
        c.wait_ready("engine", "control")
        with AdminClient(c.control_address) as admin:
            assert admin.load("saved", "saved").state == pb.ADAPTER_STATE_LOADED
            with pytest.raises(LoramuxError) as ei:
                admin.load("changed", "changed")
            assert ei.value.code.name == "INVALID_ARGUMENT"
            assert HEAD_COPY in ei.value.details and "at 1 of" in ei.value.details
            assert [a.name for a in admin.list()] == ["saved"]
    finally:
        c.close()
