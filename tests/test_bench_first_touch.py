"""benchmarks/bench_first_touch.py through its suite on the CPU (--tiny): fresh shared
buffers populated on 1 and 2 threads with the probe thread running. Checks the record,
not speed."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import adapters
from benchmarks.suite import main

pytestmark = pytest.mark.timeout(120)


def test_rows_for_each_thread_count_with_the_probe(tmp_path):
    assert main("adapters", adapters.CASES, ["first-touch", "--out", str(tmp_path),
                                             "--tiny", "--threads", "1,2"]) == 0
    result = json.loads((tmp_path / "first_touch.json").read_text())
    phases = [r["phase"] for r in result["rows"]]
    register = ["cudaHostRegister, 1 thread"] if torch.cuda.is_available() else []  # a GPU host
    assert phases == ["nothing (the probe alone)", "populate, 1 thread", *register,
                      "populate, 2 threads"]
    for r in result["rows"][1:]:
        assert r["gb_per_s"] > 0 and r["seconds"] > 0
    for r in result["rows"]:   # the probe ran through every phase
        assert r["probe_max_ms"] >= r["probe_median_ms"] >= 0
