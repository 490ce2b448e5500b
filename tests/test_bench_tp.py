"""The parallel suite's decode case (`python -m benchmarks.parallel decode --tiny`,
benchmarks/bench_tp.py), run on the CPU (two gloo ranks, the tiny test
model): every point timed with async scheduling on and off on one engine, and the
profile's collective count: an all-reduce per row-parallel layer output and the
embedding, one all-gather for the logits, the same with adapters as without. The GPU run
counts the same thing from the NCCL / one-shot kernels (`collective_of`)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.tp_probe import collective_of, count_collectives

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name,kind", [
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_reduce"),
    ("ncclKernel_AllReduce_RING_LL_Sum_bfloat16(ncclWorkElem)", "all_reduce"),
    ("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "all_gather"),
    ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL", "reduce_scatter"),
    ("ncclDevKernel_Broadcast_RING_LL", "nccl_other"),
    ("void c10d::symmetric_memory::one_shot_all_reduce_kernel<c10::BFloat16, 16, 2>(...)",
     "all_reduce"),
    ("gloo:all_reduce", "all_reduce"),
    ("gloo:all_gather", "all_gather"),
    ("gloo:broadcast", None),
    ("add_rms_norm_kernel", None),
    ("_lora_shrink_kernel", None),
])
def test_collective_of_kernel_names(name, kind):
    assert collective_of(name) == kind


def test_count_collectives_per_step():
    names = ["ncclDevKernel_AllReduce_Sum_bf16_RING_LL"] * 10 + ["gemm"] * 7 + [
        "ncclDevKernel_AllGather_RING_LL"] * 2
    assert count_collectives(names, 2) == {"all_gather": 1.0, "all_reduce": 5.0}


def test_decode_phase_on_gloo_times_async_on_and_off_and_counts_collectives(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "clients/python")])}
    cmd = [sys.executable, "-m", "benchmarks.parallel", "decode", "--tiny",
           "--tp", "2", "--batches", "2", "--modes", "base,distinct", "--async-scheduling",
           "on,off", "--steps", "2", "--repeats", "1", "--profile", "--profile-batches", "2",
           "--out", str(tmp_path)]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "async scheduling=True" in run.stdout
    rows = json.loads((tmp_path / "decode_tp2_auto.json").read_text())
    # every mode with the first setting, then with the next; profiles on the first's rows
    assert [(r["mode"], r["async"]) for r in rows] == [
        ("base", True), ("distinct", True), ("base", False), ("distinct", False)]
    assert all(r["tokens_per_s"] > 0 and r["batch"] == 2 for r in rows)
    # the tiny model has 2 layers: embedding + (o, down) per layer; the logits' all-gather
    assert [r["async"] for r in rows if "profile" in r] == [True, True]
    counts = [r["profile"]["collectives_per_step"] for r in rows if "profile" in r]
    assert counts == [{"all_gather": 1.0, "all_reduce": 5.0}] * 2
    assert "collectives per step tp=2 ar=auto distinct b=2: " in run.stdout
    record = json.loads((tmp_path / "run-parallel-decode.json").read_text())
    assert record["rc"] == 0 and record["module"] == "benchmarks.bench_tp"
    assert "decode_tp2_auto.json" in record["files"]
    # the round's last phase: the table over every JSON under the directory
    table = subprocess.run([sys.executable, "-m", "benchmarks.parallel", "table",
                            "--out", str(tmp_path), "--results", str(tmp_path / "all.json")],
                           env=env, capture_output=True, text=True, timeout=60)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "| 2 | distinct | - | " in table.stdout   # no TP=1 run here
    assert "TP=2 nccl/gloo async off | TP=2 nccl/gloo async on |" in table.stdout
    assert "collectives/step {'all_gather': 1.0, 'all_reduce': 5.0}" in table.stdout
    assert len(json.loads((tmp_path / "all.json").read_text())["rows"]) == 4
