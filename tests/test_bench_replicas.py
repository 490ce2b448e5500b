"""benchmarks/bench_replicas.py without a service: layouts parse (and refuse nonsense), and
the table compares per-GPU throughput with the one-GPU layout and reads the routing counts.
The whole benchmark runs on the CPU with --tiny (about two minutes: three service starts)."""
from __future__ import annotations

import argparse

import pytest

from benchmarks.bench_replicas import parse_layouts, table


def test_layouts():
    assert parse_layouts("1x1,2x1, 1x2") == [(1, 1), (2, 1), (1, 2)]
    assert parse_layouts("4") == [(4, 1)]
    for bad in ("2y1", "0x1", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_layouts(bad)


def row(layout, gpus, tok_s, routing):
    dist = {"p50": 0.02}
    return {"layout": layout, "gpus": gpus, "concurrency": 8 * gpus, "completed": 16,
            "requests": 16, "output_tok_per_s": tok_s, "output_tok_per_s_per_gpu": tok_s / gpus,
            "ttft_s": dist, "itl_s": dist, "routing": routing}


def test_table_is_per_gpu_against_one_gpu():
    text = table([row("1x1", 1, 1000.0, {"slot": 10}),
                  row("2x1", 2, 1800.0, {"slot": 6, "host": 1, "cold": 1, "spill": 2,
                                          "replica 0": 7, "replica 1": 3}),
                  {"layout": "1x2", "gpus": 2, "error": "RuntimeError: engine exited"}])
    lines = text.splitlines()
    assert lines[2].split("|")[5:8] == [" 1000.0 ", " 1000.0 ", " 1.00 "]
    assert lines[3].split("|")[5:8] == [" 1800.0 ", " 900.0 ", " 0.90 "]
    # (6 + 1) / 10 hits, 2 spills; the replicas' shares are not decisions
    assert lines[3].split("|")[10:13] == [" 70.0% ", " 2 ", " 7 / 3 "]
    assert "failed: RuntimeError: engine exited" in lines[4]
