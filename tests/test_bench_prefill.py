"""benchmarks/bench_prefill.py: its arithmetic, and its whole flow on the CPU with a 2-layer
toy model through the decode suite (`python -m benchmarks.decode prefill --tiny`; the real
run needs a GPU and the Llama-3-8B shape)."""
from __future__ import annotations

import json

import pytest

from benchmarks import bench_prefill, decode, suite
from benchmarks.llama8b import LLAMA3_8B


def test_adapters_per_step_follows_fcfs_packing():
    # budget 10: [a:6, b:6 -> 4 here], [b:2, c:8], [c:1] -> {a,b}, {b,c}, {c}
    assert bench_prefill.adapters_per_step([6, 6, 9], ["a", "b", "c"], 10) == 5 / 3
    assert bench_prefill.adapters_per_step([6, 6, 9], [None] * 3, 10) == 0


def test_flops_count_projections_and_causal_attention():
    cfg = LLAMA3_8B
    one = bench_prefill.flops(cfg, [1])
    linear = 2 * 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert one == linear + 2 * 32 * 4096
    two = bench_prefill.flops(cfg, [1024, 1024])
    assert two == 2 * bench_prefill.flops(cfg, [1024])
    assert bench_prefill.flops(cfg, [2048]) > two       # attention grows with n^2


@pytest.mark.engine_device("cpu")  # the device its --device names, whatever the suite's
def test_whole_flow_on_the_cpu(tmp_path, capsys):
    rc = suite.main("decode", decode.CASES, ["prefill", "--out", str(tmp_path), "--tiny",
                                             "--prompts", "5", "--min-len", "3", "--max-len",
                                             "30", "--paths", "tiles"])
    assert rc == 0
    record = json.loads((tmp_path / "run-decode-prefill.json").read_text())
    assert (record["rc"], record["files"]) == (0, ["prefill.json"])
    assert record["command"][3:5] == ["prefill", "--out"] and record["commit"]
    rows = json.loads((tmp_path / "prefill.json").read_text())["rows"]
    assert [(r["mode"], r["path"]) for r in rows] == [
        ("base", "-"), ("one", "tiles"), ("l64", "tiles")]
    lengths = bench_prefill.prompt_lengths(5, 3, 30)
    assert all(r["tokens"] == sum(lengths) and r["tokens_per_s"] > 0 for r in rows)
    assert rows[0]["x_base"] == 1.0 and rows[2]["adapters_per_step"] >= 1
    assert "| l64 | tiles | 5 |" in capsys.readouterr().out
