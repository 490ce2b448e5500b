"""The LoRA kernel planner knows the rank (kernels/lora/plan.py, plan_table.py): unit
tests over its table, and every form it can pick against the torch reference at ranks 8
to 128, one adapter and many, on fresh random inputs (Triton's interpreter on the CPU)."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from loramux_kernels.lora import mixed, plan, token
from loramux_kernels.lora.launch import add_lora_on, build_meta
from loramux_kernels.lora.plan import MIXED, TILES, TOKENS, choose, lookup
from loramux_kernels.lora.plan_table import (NOT_MEASURED, R16_MANY, RANK_BUCKETS, TABLE,
                                             TOKEN_BUCKETS)
from loramux_kernels.lora.reference import add_lora_ref
from tests.support.lora_pool import slot_pool
from tests.support.triton_mode import check_kernel_mode

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
GROUPS = {"qkv": (3, 4096, 4096), "o": (1, 4096, 4096), "gate_up": (2, 4096, 14336),
          "down": (1, 14336, 4096)}   # slices, input width, widest slice (Llama-3-8B)


def test_every_gpu_has_every_cell_and_names_its_measurement():
    for gpu, rows in TABLE.items():
        assert set(rows) == {(k, r, n) for k in plan.KINDS for r in RANK_BUCKETS
                             for n in ("one", "many")}, gpu
        for key, (forms, source) in rows.items():
            assert len(forms) == len(TOKEN_BUCKETS) and set(forms) <= set(plan.FORMS), key
            assert source == NOT_MEASURED or (RESULTS / source).is_file(), (key, source)


def test_measured_rows_take_the_fastest_form_their_grid_timed():
    """A row that names a planner grid run (benchmarks/plan_grid.py's plan.csv) takes, at
    every token bucket, the form that run timed fastest."""
    checked = 0
    for gpu, rows in TABLE.items():
        for (kind, rank, adapters), (forms, source) in rows.items():
            if not source.endswith("plan.csv"):
                continue
            with open(RESULTS / source) as f:
                timed = {int(r["T"]): r for r in csv.DictReader(f) if (
                    r["group"], int(r["rank"]), r["adapters"]) == (kind, rank, adapters)}
            for t, form in zip(TOKEN_BUCKETS, forms):
                us = {f: float(timed[t][f"{f}_us"]) for f in plan.FORMS if timed[t][f"{f}_us"]}
                assert form == min(us, key=us.get), (gpu, kind, rank, adapters, t, us)
                checked += 1
    assert checked >= 6 * 21


@pytest.mark.parametrize("kind", list(GROUPS))
def test_one_adapter_at_high_rank_leaves_the_token_kernels(kind):
    """One adapter of rank 32 and up at 256 tokens no longer takes the token kernels,
    which re-read it for every token (measured: up to 13x slower); at one token and at
    ranks 8 and 16 up to 128 tokens they stay. choose() reads the same table."""
    S, K, widest = GROUPS[kind]
    for gpu in ("H100", "H200", None):
        for rank in (32, 64, 128):
            assert lookup(gpu, kind, rank, 256, True) != TOKENS, (gpu, rank)
            assert lookup(gpu, kind, rank, 1, True) == TOKENS, (gpu, rank)
        for rank in (8, 16):
            assert all(lookup(gpu, kind, rank, t, True) == TOKENS for t in (1, 16, 64, 128))
    assert choose("cpu", 256, True, False, S, K, widest, 128) == TILES
    assert choose("cpu", 16, True, False, S, K, widest, 128) == TOKENS


def test_rank_buckets_and_many_adapters():
    assert [plan.bucket(r, RANK_BUCKETS) for r in (1, 8, 9, 24, 33, 128, 256)] == \
        [8, 8, 16, 32, 64, 128, 128]
    for rank in RANK_BUCKETS:   # many adapters: rank 16's measured forms at every rank
        assert lookup("H100", "down", rank, 64, False) == TOKENS
        assert lookup("H100", "down", rank, 200, False) == MIXED
        assert choose("cpu", 200, False, True, 1, 14336, 4096, rank) == TOKENS   # spread
    assert choose("cpu", 300, True, False, 1, 14336, 4096, 8) == TILES           # prefill


def test_unmeasured_rows_follow_the_rule_and_measured_mixed_cells_have_parameters():
    for gpu, rows in TABLE.items():
        for (kind, rank, adapters), (forms, source) in rows.items():
            if source == NOT_MEASURED and adapters == "one":
                want = [TILES if rank >= 32 and t >= 32 else TOKENS for t in TOKEN_BUCKETS]
                assert list(forms) == want, (kind, rank)
            if source == R16_MANY:   # the mixed kernels' parameters were measured with them
                cells = {(t, kind) for t, f in zip(TOKEN_BUCKETS, forms) if f == MIXED}
                assert cells <= set(mixed.PARAMS[gpu]), (kind, cells)


def test_kernels_run_as_this_machine_needs():
    check_kernel_mode(token)


SLICES = {1: (0, 40), 2: (0, 24, 48), 3: (0, 32, 40, 48)}
K_IN = 32


@pytest.mark.parametrize("form", [TOKENS, MIXED, TILES])
@pytest.mark.parametrize("rank", RANK_BUCKETS)
@pytest.mark.parametrize("adapters", [1, 5])
def test_every_form_matches_the_reference_at_every_rank(form, rank, adapters):
    """Whatever the table says at a rank, each form it may name is exact there: a pool
    of `rank`-wide slots (slots below it too when several), random A and B, random y."""
    S = 1 + rank % 3
    offsets = SLICES[S]
    T = 40 if adapters == 1 else 24
    ranks = [rank] if adapters == 1 else [rank, max(1, rank // 2), 3, rank, 1]
    a, b, r = slot_pool(S, offsets, ranks, K_IN, torch.float32, DEV, rank, seed=rank + S)
    g = torch.Generator().manual_seed(rank + adapters)
    ts = (torch.zeros(T, dtype=torch.long) if adapters == 1
          else torch.randint(-1, adapters, (T,), generator=g)).to(DEV)
    x = torch.randn(T, K_IN, generator=g).to(DEV)
    y = torch.randn(T, offsets[-1], generator=g).to(DEV)
    want = add_lora_ref(y.clone(), x, a, b, ts, offsets)
    got = add_lora_on(form, y.clone(), x, a, b, build_meta(ts, a.shape[0]), offsets, r,
                      uniform=adapters == 1)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# the --tiny grid runs the kernels in Triton's interpreter, which a GPU host's tests do not
# use (its kernels are compiled when this process first imports them)
@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's interpreted --tiny case")
def test_planner_grid_tiny_writes_rows_the_table_takes(tmp_path):
    """`python -m benchmarks.kernels lora --tiny` (the planner grid on the CPU): every
    form checked and timed per cell, plan.csv written, and plan_table.py a block of
    rows in the table's layout: the measured rows name their file, the rest are kept."""
    from benchmarks import kernels, suite
    argv = ["lora", "--tiny", "--out", str(tmp_path), "--groups", "o", "--ranks", "64"]
    assert suite.main("kernels", kernels.CASES, argv) == 0
    csv = (tmp_path / "plan.csv").read_text().splitlines()
    assert csv[0].split(",")[-3:] == ["tokens_us", "mixed_us", "tiles_us"]
    assert len(csv) == 1 + 2 * len(TOKEN_BUCKETS)              # o at rank 64: one, many
    assert all("inf" not in line for line in csv)             # every form agreed
    rows = {}
    exec((tmp_path / "plan_table.py").read_text(), {}, rows)
    (block,) = rows.values()
    assert set(block) == set(TABLE["H100"])
    for key, (forms, source) in block.items():
        assert set(forms) <= set(plan.FORMS)
        measured = key in (("o", 64, "one"), ("o", 64, "many"))
        assert source.endswith("-cpu/plan.csv") == measured, key
        if not measured:
            assert (forms, source) == TABLE["H100"][key]
