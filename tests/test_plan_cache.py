"""PlanCache (loramux_core/adapter/plan.py): a plan made with the cache equals one made
without it, names its own files, and a refusal is never taken from the cache."""
from __future__ import annotations

import json
import shutil

import pytest

from loramux_core.adapter.plan import PlanCache, plan_adapter
from loramux_core.errors import AdapterError
from loramux_core.model.hf_config import ModelConfig


@pytest.mark.parametrize("header_only", [True, False])
def test_cached_plans_equal_fresh_ones_and_name_their_files(llama_family, tmp_path,
                                                            header_only):
    cfg = ModelConfig.from_dir(llama_family.model_dir)
    twin = shutil.copytree(llama_family.adapters["ap8"], tmp_path / "twin")
    cache = PlanCache()
    first = plan_adapter(llama_family.adapters["ap8"], cfg, 32, header_only=header_only,
                         cache=cache)
    hit = plan_adapter(twin, cfg, 32, header_only=header_only, cache=cache)
    fresh = plan_adapter(twin, cfg, 32, header_only=header_only)
    assert hit.modules == fresh.modules == first.modules and hit.tensors == fresh.tensors
    assert hit.weights_file == fresh.weights_file != first.weights_file
    assert hit.config == fresh.config and "twin" in hit.config.file
    assert len(cache._entries) == 2  # the config's targets and its header's tensors
    if not header_only:
        assert hit.version == fresh.version


def test_a_refusal_is_worked_out_again(llama_family, tmp_path):
    cfg = ModelConfig.from_dir(llama_family.model_dir)
    cache = PlanCache()
    plan_adapter(llama_family.adapters["rs4"], cfg, 32, cache=cache)
    bad = shutil.copytree(llama_family.adapters["rs4"], tmp_path / "bad")
    config = json.loads((bad / "adapter_config.json").read_text())
    config["r"] = 8  # the tensors are rank 4: the same header, another config
    (bad / "adapter_config.json").write_text(json.dumps(config))
    for _ in range(2):
        with pytest.raises(AdapterError, match="shape") as info:
            plan_adapter(bad, cfg, 32, cache=cache)
        assert info.value.file.endswith("bad/adapter_model.safetensors")
