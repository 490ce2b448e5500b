"""Fewer kernel variants to compile at start-up: a step's token count (T) and sequence
count (num_seqs) change from step to step, and a kernel that let Triton specialise on
them would be compiled up to three times per other combination of its keys (the value
1, a multiple of 16, any other). No kernel the warm-up launches is keyed by their value
class (tests/support/launch_keys.py keys launches as Triton does, do_not_specialize
included); the warm-up's coverage of traffic is tests/test_warmup.py's."""
import inspect
import re
from pathlib import Path

import pytest

import loramux_kernels
from tests.support.launch_keys import LaunchKeys
from tests.support.triton_mode import triton_kernels
from tests.test_warmup import KERNEL_MODULES, SMALL, cpu_model, warmed_engine

PER_STEP_COUNTS = ("T", "num_seqs")


@cpu_model
def test_no_kernel_is_keyed_by_a_steps_counts(llama_family, monkeypatch):
    eng, keys = warmed_engine(llama_family, monkeypatch, SMALL)
    launched = {name for name, _ in keys.keys}
    assert {"paged_attn_kernel", "add_rms_norm_shrink_kernel",
            "lora_shrink_tok_kernel"} <= launched
    keyed = sorted({(name, arg, spec) for name, key in keys.keys for arg, spec in key
                    if arg in PER_STEP_COUNTS and spec != "int"})
    assert not keyed, f"kernels keyed by a step's counts: {keyed[:4]}"


@pytest.mark.parametrize("module", KERNEL_MODULES,
                         ids=lambda m: m.__name__.split(".")[-1])
def test_kernels_taking_a_steps_counts_do_not_specialise_on_them(module):
    """Also the kernels the CPU warm-up does not launch: launches with a count of 1, 16
    and 17 are one key."""
    rec = LaunchKeys()
    for name, kernel in triton_kernels(module).items():
        params = list(inspect.signature(kernel.fn).parameters)
        if not set(params) & set(PER_STEP_COUNTS) or name not in LAUNCHED:
            continue
        record = rec._hook(name, kernel)
        for count in (1, 16, 17):
            record(**{p: count if p in PER_STEP_COUNTS else 2 for p in params})
        assert len({k for n, k in rec.keys if n == name}) == 1, name


def _launched() -> set[str]:
    """Kernels the host code launches (`name[grid](...)`), not helpers inlined in one."""
    src = "".join(p.read_text() for p in Path(loramux_kernels.__file__).parent.rglob("*.py"))
    return set(re.findall(r"\.(\w+_kernel)\[", src))


LAUNCHED = _launched()
