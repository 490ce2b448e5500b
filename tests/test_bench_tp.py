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
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), str(REPO)]))}
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


def test_the_table_and_curve_cover_every_tp_size(tmp_path):
    """Rows of TP=1, 2 and 4 (as the two- and four-GPU rounds write them): a column per
    setting, the best TP=N over TP=1 for each N, and the curve drawn."""
    from types import SimpleNamespace

    from benchmarks.bench_tp import table

    def row(tp, batch, mode, tok, allreduce="auto", used="nccl", async_on=True):
        return {"tp": tp, "allreduce": allreduce, "in_use": used, "async": async_on,
                "mode": mode, "batch": batch, "tokens_per_s": tok, "step_ms": batch / tok * 1e3}
    rows = [row(1, 64, "base", 1000.0), row(2, 64, "base", 1500.0),
            row(2, 64, "base", 1600.0, used="one-shot (symm_mem)"),
            row(4, 64, "base", 2500.0, used="one-shot (symm_mem)"),
            row(1, 256, "distinct", 2000.0),
            row(4, 256, "distinct", 3000.0, used="one-shot (symm_mem)")]
    (tmp_path / "decode_x.json").write_text(json.dumps(rows))
    result = table(SimpleNamespace(out=tmp_path, results=tmp_path / "all.json"))
    lines = result["table"].splitlines()
    assert lines[0] == ("| batch | mode | TP=1 tok/s | TP=2 1shot async on | "
                        "TP=2 nccl/gloo async on | TP=4 1shot async on | best TP=2 / TP=1 | "
                        "best TP=4 / TP=1 |")
    assert lines[2].endswith("| 1.60x | 2.50x |") and lines[2].startswith("| 64 | base | 1,000")
    assert lines[3].endswith("| - | 1.50x |")   # no TP=2 point at batch 256
    curve = {(c["batch"], c["mode"]): c["tokens_per_s"] for c in result["curve"]}
    assert curve == {(64, "base"): {"1": 1000.0, "2": 1600.0, "4": 2500.0},
                     (256, "distinct"): {"1": 2000.0, "4": 3000.0}}
    png = tmp_path / "tp_curve.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
