"""benchmarks/bench_admin_loads.py through its suite on the CPU (--tiny): the real service,
loads by LoadAdapters batches and then by concurrent LoadAdapter calls, in that order,
while base-model streams decode in a process of their own, once the engine's host
reserve is complete. Checks the record, not speed."""
from __future__ import annotations

import json

import pytest

from benchmarks import adapters
from benchmarks.bench_admin_loads import parse_modes
from benchmarks.suite import main

pytestmark = [pytest.mark.timeout(300), pytest.mark.engine_device("cpu")]


def test_modes_in_the_order_asked_each_with_its_decode_gaps(tmp_path):
    rc = main("adapters", adapters.CASES, [
        "admin", "--out", str(tmp_path), "--tiny", "--adapters", "30", "--distinct", "2",
        "--mode", "batch,calls", "--batch", "5", "--concurrency", "4", "--streams", "2",
        "--window", "1"])
    result = json.loads((tmp_path / "admin_loads.json").read_text())
    assert rc == 0, result
    rows = result["rows"]
    assert [(r["mode"], r["host_memory"]) for r in rows] == [("batch", "reserve (wait)"),
                                                             ("calls", "reused")]
    # waited for: the 16 buffers --tiny asks for were ready before the first loads
    waited = result["reserve_waited"]
    assert waited["target"] == waited["ready"] == 16 and waited["taken"] == 0
    assert waited["complete_after_serving_s"] >= 0
    assert rows[0]["reserve_before"]["ready"] == 16
    assert rows[0]["reserve_after"]["taken"] == 16   # 30 loads, 16 buffers
    for r in rows:
        assert r["failed"] == [] and r["adapters"] == 30 and r["loads_per_s"] > 0
        # the streams' process sent its token times for both windows
        assert r["decode_before"]["tokens"] > 0 and r["decode_during"]["tokens"] > 0
    assert (tmp_path / "logs" / "engine.log").exists()


def test_mode_lists():
    assert parse_modes("both") == ("calls", "batch")
    assert parse_modes("batch,calls") == ("batch", "calls")
    with pytest.raises(Exception):
        parse_modes("calls,nope")
