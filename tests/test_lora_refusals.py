"""Adapters the engine must refuse: each gets an AdapterError naming the feature and the
file, from both validate_lora (header only) and load_lora, and nothing is loaded."""
from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from loramux_engine.lora import LoRASlotPool, load_lora, validate_lora
from loramux_core.adapter.config import _MATH_CHANGING_FLAGS
from loramux_core.model.hf_config import ModelConfig
from loramux_core.errors import AdapterError
from tests.support.tiny import AdapterSpec, make_adapter, make_model, read_json, write_json

MAX_RANK = 16
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_refusals")
    model_dir = make_model(root / "model")
    good = make_adapter(root / "good", model_dir, AdapterSpec(r=8))
    return ModelConfig.from_dir(model_dir), model_dir, good, root


@pytest.fixture
def adapter(base, tmp_path):
    """A fresh copy of a valid adapter to break."""
    return shutil.copytree(base[2], tmp_path / "adapter")


def edit_config(d, **changes):
    write_json(d / CONFIG, {**read_json(d / CONFIG), **changes})


def edit_tensors(d, fn):
    tensors = load_file(d / WEIGHTS)
    fn(tensors)
    save_file(tensors, d / WEIGHTS, metadata={"format": "pt"})


def _validate_header_only(d, cfg, max_rank):
    """The control plane's check before it lets the engines read and hash the files."""
    return validate_lora(d, cfg, max_rank, header_only=True)


def refused(cfg, d, feature, file_name, max_rank=MAX_RANK, header_only=True):
    """Every entry point raises AdapterError(feature) whose message names the file
    (`header_only` False: a refusal of the values, which only load_lora reads)."""
    calls = [load_lora] + ([validate_lora, _validate_header_only] if header_only else [])
    for fn in calls:
        with pytest.raises(AdapterError) as ei:
            fn(d, cfg, max_rank)
        assert ei.value.feature == feature, (fn.__name__, str(ei.value))
        assert file_name in str(ei.value) and ei.value.file.endswith(file_name)
    return str(ei.value)


def test_good_adapter_loads(base, adapter):
    cfg = base[0]
    full, head = validate_lora(adapter, cfg, MAX_RANK), _validate_header_only(adapter, cfg, MAX_RANK)
    assert full.max_rank == head.max_rank == load_lora(adapter, cfg, MAX_RANK).max_rank == 8
    assert full.target_modules == head.target_modules and full.modules == head.modules
    assert full.version and head.version == ""     # the header-only check hashes nothing
    size = (adapter / WEIGHTS).stat().st_size
    assert len(head.weights) < size and len(full.weights) == size


def test_missing_config(base, adapter):
    (adapter / CONFIG).unlink()
    refused(base[0], adapter, "adapter_config", CONFIG)


def test_malformed_json(base, adapter):
    (adapter / CONFIG).write_text('{"r": 8, "lora_alpha": ')
    refused(base[0], adapter, "adapter_config", CONFIG)


def test_pickle_only(base, adapter):
    (adapter / WEIGHTS).unlink()
    (adapter / "adapter_model.bin").write_bytes(b"never unpickled")
    refused(base[0], adapter, "pickle", "adapter_model.bin")


def test_no_weights(base, adapter):
    (adapter / WEIGHTS).unlink()
    refused(base[0], adapter, "weights", WEIGHTS)


def test_corrupt_safetensors(base, adapter):
    (adapter / WEIGHTS).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    refused(base[0], adapter, "safetensors", WEIGHTS)


def test_peft_type(base, adapter):
    edit_config(adapter, peft_type="IA3")
    refused(base[0], adapter, "peft_type", CONFIG)


@pytest.mark.parametrize("overrides,feature,file_name", [
    (dict(bias="lora_only"), "bias", CONFIG),
    (dict(modules_to_save=["lm_head"]), "modules_to_save", CONFIG),
    (dict(lora_bias=True), "lora_bias", CONFIG),
], ids=["bias", "modules_to_save", "lora_bias"])
def test_written_by_peft(base, tmp_path, overrides, feature, file_name):
    cfg, model_dir = base[0], base[1]
    d = make_adapter(tmp_path / "a", model_dir, AdapterSpec(r=4), **overrides)
    msg = refused(cfg, d, feature, file_name)
    for module in overrides.get("modules_to_save", ()):  # never silently ignored: named
        assert module in msg


@pytest.mark.parametrize("targets", [("q_proj", "embed_tokens"), ("v_proj", "lm_head")],
                         ids=["embed_tokens", "lm_head"])
def test_embedding_and_head_targets(base, tmp_path, targets):
    """Served (parity: tests/test_end_lora_parity.py, on the kernel path
    tests/test_kernel_path_extras.py; at TP=2 tests/test_moe_tp.py); their tensors without
    the target are refused."""
    cfg, model_dir = base[0], base[1]
    d = make_adapter(tmp_path / "a", model_dir, AdapterSpec(r=4, target_modules=targets))
    assert targets[1] in load_lora(d, cfg, MAX_RANK).ends
    edit_config(d, target_modules=list(targets[:1]))
    msg = refused(cfg, d, "tensor", WEIGHTS)
    assert "target_modules does not select" in msg and targets[1] in msg


def test_dora_tensors_without_flag(base, tmp_path):
    d = make_adapter(tmp_path / "a", base[1], AdapterSpec(r=4), use_dora=True)
    edit_config(d, use_dora=False)
    msg = refused(base[0], d, "use_dora", WEIGHTS)
    assert "lora_magnitude_vector" in msg


def test_lora_embedding_keys(base, adapter):
    edit_tensors(adapter, lambda t: t.update({
        "base_model.model.model.layers.0.mlp.lora_embedding_A": torch.ones(8, 10)}))
    refused(base[0], adapter, "embedding", WEIGHTS)


def test_saved_base_layer_copies_refused(base, tmp_path):
    """A full copy of a base layer is served only for embed_tokens and lm_head when the
    adapter targets them (tests/test_base_layer_copies.py: their values); a copy of any
    other layer, or of an end the adapter does not target, is refused by name."""
    d = make_adapter(tmp_path / "a", base[1], AdapterSpec(r=4, target_modules=("q_proj",)))
    edit_tensors(d, lambda t: t.update({
        "base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight": torch.ones(64, 64)}))
    assert "q_proj.base_layer" in refused(base[0], d, "save_embedding_layers", WEIGHTS)
    edit_tensors(d, lambda t: (
        t.pop("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"),
        t.update({"base_model.model.model.embed_tokens.base_layer.weight": torch.ones(384, 64)})))
    msg = refused(base[0], d, "save_embedding_layers", WEIGHTS)
    assert "embed_tokens.base_layer" in msg and "target_modules does not select" in msg


def test_end_target_shapes_checked(base, tmp_path):
    d = make_adapter(tmp_path / "a", base[1], AdapterSpec(r=4, target_modules=("q_proj", "lm_head")))
    edit_tensors(d, lambda t: t.update({"base_model.model.lm_head.lora_B.weight": torch.ones(8, 4)}))
    msg = refused(base[0], d, "shape", WEIGHTS)
    assert "lm_head" in msg


def test_fan_in_fan_out(base, adapter):
    edit_config(adapter, fan_in_fan_out=True)
    refused(base[0], adapter, "fan_in_fan_out", CONFIG)


@pytest.mark.parametrize("flag", _MATH_CHANGING_FLAGS)
def test_math_changing_flags(base, adapter, flag):
    value = {"alora_invocation_tokens": [5, 6], "layer_replication": [[0, 2], [1, 2]],
             "trainable_token_indices": [3]}.get(flag, True)
    edit_config(adapter, **{flag: value})
    refused(base[0], adapter, flag, CONFIG)


def test_target_parameters_on_a_dense_model(base, adapter):
    """Llama has no fused expert weights: PEFT target_parameters is refused, naming it
    (Qwen2-MoE serves them: tests/test_moe_refusals.py)."""
    edit_config(adapter, target_parameters=["mlp.experts.down_proj"])
    msg = refused(base[0], adapter, "target_parameters", CONFIG)
    assert "LlamaForCausalLM" in msg


def test_base_rewriting_init(base, adapter):
    edit_config(adapter, init_lora_weights="pissa_niter_4")
    refused(base[0], adapter, "init_lora_weights", CONFIG)


def test_rank_above_max(base, adapter):
    msg = refused(base[0], adapter, "rank", CONFIG, max_rank=4)
    assert "r=8" in msg and "max_lora_rank=4" in msg


def test_rank_pattern_above_max(base, adapter):
    # a pattern value alone exceeding the limit is refused even before shapes are read
    edit_config(adapter, rank_pattern={"down_proj": 64})
    msg = refused(base[0], adapter, "rank", CONFIG)
    assert "rank_pattern" in msg and "64" in msg


def test_unknown_target(base, adapter):
    edit_config(adapter, target_modules=["q_proj", "fc_in"])
    assert "fc_in" in refused(base[0], adapter, "target_modules", CONFIG)


def test_regex_matching_nothing(base, adapter):
    edit_config(adapter, target_modules=r".*\.attention\.wq")
    refused(base[0], adapter, "target_modules", CONFIG)


def test_shape_mismatch(base, adapter):
    edit_tensors(adapter, lambda t: t.update({f"{Q0}.lora_B.weight": torch.zeros(60, 8)}))
    msg = refused(base[0], adapter, "shape", WEIGHTS)
    assert f"{Q0}.lora_B.weight" in msg and "[60, 8]" in msg and "[64, 8]" in msg


def test_other_base_model(base, tmp_path):
    from tests.support.tiny import TinySpec
    other = ModelConfig.from_dir(make_model(tmp_path / "m", TinySpec(hidden_size=32)))
    refused(other, base[2], "shape", WEIGHTS)


def test_missing_tensor(base, adapter):
    edit_tensors(adapter, lambda t: t.pop(f"{Q0}.lora_A.weight"))
    assert f"{Q0}.lora_A.weight" in refused(base[0], adapter, "missing_tensor", WEIGHTS)


def test_layer_beyond_model(base, adapter):
    key = "base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"
    edit_tensors(adapter, lambda t: t.update({key: torch.zeros(8, 64)}))
    assert "layer 7" in refused(base[0], adapter, "layer_index", WEIGHTS)


def test_layers_to_transform_beyond_model(base, adapter):
    edit_config(adapter, layers_to_transform=[0, 5])
    refused(base[0], adapter, "layers_to_transform", CONFIG)


def test_unsupported_layers_pattern(base, adapter):
    edit_config(adapter, layers_to_transform=[0], layers_pattern="h")
    refused(base[0], adapter, "layers_pattern", CONFIG)


def test_tensor_of_untargeted_module(base, adapter):
    edit_config(adapter, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    assert "mlp" in refused(base[0], adapter, "tensor", WEIGHTS)


def test_non_finite_values(base, adapter):
    def poison(t):
        t[f"{Q0}.lora_B.weight"][3, 1] = float("nan")
    edit_tensors(adapter, poison)
    assert validate_lora(adapter, base[0], MAX_RANK).max_rank == 8  # header-only check
    refused(base[0], adapter, "non_finite", WEIGHTS, header_only=False)


def pool_state(pool):
    return [t.clone() for layer in range(pool.num_layers) for g in pool.groups
            for t in pool.weights(layer, g)[:3]]


def test_refusals_leave_pool_untouched(base, adapter, tmp_path):
    cfg, model_dir, good, _ = base
    pool = LoRASlotPool(cfg, max_loras=2, max_lora_rank=8)
    pool.load(0, load_lora(good, cfg, MAX_RANK))
    before = pool_state(pool)
    big = load_lora(make_adapter(tmp_path / "r16", model_dir, AdapterSpec(r=16)), cfg, MAX_RANK)
    with pytest.raises(AdapterError) as ei:
        pool.load(1, big)  # over this pool's max_lora_rank
    assert ei.value.feature == "rank" and WEIGHTS in str(ei.value)
    edit_config(adapter, use_dora=True)
    with pytest.raises(AdapterError):
        pool.load(1, load_lora(adapter, cfg, 8))
    assert before[0].any()
    assert all(torch.equal(x, y) for x, y in zip(before, pool_state(pool)))


def test_keys_with_adapter_name_load_the_same(base, adapter):
    """Older PEFT files keep the adapter name in keys (`lora_A.default.weight`)."""
    cfg = base[0]
    plain = load_lora(adapter, cfg, MAX_RANK)

    def rename(t):
        for k in list(t):
            t[k.replace(".weight", ".default.weight")] = t.pop(k)
    edit_tensors(adapter, rename)
    named = load_lora(adapter, cfg, MAX_RANK)
    assert plain.groups.keys() == named.groups.keys()
    for k, g in plain.groups.items():
        assert torch.equal(g.a, named.groups[k].a) and torch.equal(g.b, named.groups[k].b)


@pytest.mark.parametrize("suffix,feature", [("lora_B.bias", "lora_bias"),
                                            ("lora_B.default.bias", "lora_bias"),
                                            ("base_layer.bias", "bias")])
def test_bias_tensors(base, adapter, suffix, feature):
    edit_tensors(adapter, lambda t: t.update({f"{Q0}.{suffix}": torch.zeros(64)}))
    refused(base[0], adapter, feature, WEIGHTS)


def test_version_is_the_hash_of_the_bytes_served(base, adapter):
    """A same-size, same-mtime change of one weight is a new version: refused under the
    old one (what the engine does for a registered or loaded id)."""
    from loramux_core.errors import AdapterChangedError
    cfg = base[0]
    version = validate_lora(adapter, cfg, MAX_RANK).version
    assert load_lora(adapter, cfg, MAX_RANK, expected_version=version).version == version
    path = adapter / WEIGHTS
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[-1] ^= 1                                   # last byte of the last tensor
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(AdapterChangedError):
        load_lora(adapter, cfg, MAX_RANK, expected_version=version)
    assert validate_lora(adapter, cfg, MAX_RANK).version != version


def test_versions_recorded_as_plain_sha256_are_still_honoured(base, adapter):
    """A registry written when versions were the plain sha256 of each file: the same
    bytes load under that version, changed bytes do not."""
    import hashlib

    from loramux_core.errors import AdapterChangedError
    cfg = base[0]

    def plain_version() -> str:
        h = hashlib.sha256()
        for name in (CONFIG, WEIGHTS):
            h.update(f"{name}\0{hashlib.sha256((adapter / name).read_bytes()).hexdigest()}\n"
                     .encode())
        return h.hexdigest()
    old = plain_version()
    assert old != validate_lora(adapter, cfg, MAX_RANK).version
    assert load_lora(adapter, cfg, MAX_RANK, expected_version=old).max_rank == 8
    data = bytearray((adapter / WEIGHTS).read_bytes())
    data[-1] ^= 1
    (adapter / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(AdapterChangedError):
        load_lora(adapter, cfg, MAX_RANK, expected_version=old)


def test_versions_recorded_as_chunked_sha256_are_still_honoured(base, adapter, monkeypatch):
    """A registry written when versions were the v1 digest (sha256 of each 4 MiB chunk):
    the same bytes load under that version, changed bytes do not; a read under the
    current version never hashes the files the v1 way."""
    import hashlib

    from loramux_core import file_digest
    from loramux_core.errors import AdapterChangedError
    cfg = base[0]

    def v1(data: bytes) -> str:
        parts = [hashlib.sha256(data[o:o + (4 << 20)]).digest()
                 for o in range(0, max(len(data), 1), 4 << 20)]
        return hashlib.sha256(b"loramux chunked sha256 v1\n" + len(data).to_bytes(8, "little")
                              + b"".join(parts)).hexdigest()

    def v1_version() -> str:
        h = hashlib.sha256()
        for name in (CONFIG, WEIGHTS):
            h.update(f"{name}\0{v1((adapter / name).read_bytes())}\n".encode())
        return h.hexdigest()
    old, now = v1_version(), validate_lora(adapter, cfg, MAX_RANK).version
    assert old != now
    v1_hashes = []
    real_v1 = file_digest.file_digest_v1
    monkeypatch.setattr(file_digest, "file_digest_v1",
                        lambda data, threads=1: v1_hashes.append(len(data)) or real_v1(data, threads))
    size = (adapter / WEIGHTS).stat().st_size
    assert load_lora(adapter, cfg, MAX_RANK, expected_version=now).version == now
    assert size not in v1_hashes
    assert load_lora(adapter, cfg, MAX_RANK, expected_version=old).max_rank == 8
    assert size in v1_hashes
    data = bytearray((adapter / WEIGHTS).read_bytes())
    data[len(data) // 2] ^= 1
    (adapter / WEIGHTS).write_bytes(bytes(data))
    with pytest.raises(AdapterChangedError):
        load_lora(adapter, cfg, MAX_RANK, expected_version=old)


def test_linked_files_inside_a_root_are_refused(base, adapter, tmp_path):
    from loramux_core.safe_files import AdapterRoots
    cfg = base[0]
    roots = AdapterRoots([str(tmp_path)])
    assert load_lora("adapter", cfg, MAX_RANK, roots=roots).max_rank == 8
    real = tmp_path / "elsewhere.safetensors"
    (adapter / WEIGHTS).rename(real)
    os.symlink(real, adapter / WEIGHTS)
    for fn in (load_lora, validate_lora):
        with pytest.raises(AdapterError, match="symbolic link") as ei:
            fn("adapter", cfg, MAX_RANK, roots=roots)
        assert ei.value.feature == "not_a_file"
