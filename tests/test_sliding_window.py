"""A model with a sliding attention window (Mistral, window 7: shorter than most prompts,
than the prefill chunk and than a cache block's reach of a few blocks) served on the
kernel path CUDA takes, its Triton paged attention masking to the window (in Triton's
interpreter on the CPU; natively with LORAMUX_TEST_DEVICE=cuda): greedy tokens and
logprobs equal transformers' + PEFT's in a mixed batch of adapters and base requests,
through chunked prefill, decodes past the window and, on a second round, prefix-cache hits
that start a chunk deep in a sequence."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import ADAPTER_SPECS, TEST_DEVICE, HFOracle, TinyFamily
from tests.support.launch_keys import force_triton
from tests.support.tiny import make_adapter, make_model
from tests.test_arch_parity import ADAPTERS, LENGTHS, SPECS, WINDOW
from tests.test_engine_parity import GREEDY, MAX_NEW, assert_matches, make_engine, prompts_of


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("sliding_window")
    model_dir = make_model(root / "model", SPECS["mistral_window"])
    adapters = {name: make_adapter(root / name, model_dir, spec)
                for name, spec in ADAPTER_SPECS.items()}
    return TinyFamily("mistral_window", model_dir, adapters)


def test_engine_matches_hf_on_the_attention_kernels(family, monkeypatch):
    if torch.cuda.is_available() and TEST_DEVICE == "cpu":   # compiled kernels, CPU tensors
        pytest.skip("with CUDA the kernel path needs the engine there: LORAMUX_TEST_DEVICE=cuda")
    from loramux_kernels import attention_triton
    windows = []
    kernel = attention_triton.paged_attention

    def recorded(*args, window=None, **kwargs):
        windows.append(window)
        return kernel(*args, window=window, **kwargs)
    force_triton(monkeypatch)
    monkeypatch.setattr(attention_triton, "paged_attention", recorded)
    prompts = prompts_of(LENGTHS, seed=5)
    refs = HFOracle(family).generate(prompts, ADAPTERS, MAX_NEW)
    eng = make_engine(family)
    try:
        first = eng.generate(prompts, GREEDY, ADAPTERS)
        again = eng.generate(prompts, GREEDY, ADAPTERS)   # prefixes now cached
    finally:
        eng.close()
    assert_matches(first, refs)
    assert_matches(again, refs)
    assert windows and set(windows) == {WINDOW}
    assert max(LENGTHS) + MAX_NEW > 4 * WINDOW
    assert any(o.num_cached_tokens > WINDOW for o in again)
