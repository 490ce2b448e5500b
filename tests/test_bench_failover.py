"""benchmarks/bench_failover.py through its suite on the CPU (--tiny): `loramux serve
--replicas 2` itself, a closed loop of greedy streams, replica 1 SIGKILLed mid-run. The
benchmark exits 0 only when no stream failed and every stream's tokens equal the no-fault
round's (the CPU repeats a fault-free round exactly: the control round checks that);
the record says the replica came back and serve stayed up."""
from __future__ import annotations

import json

import pytest

from benchmarks import parallel
from benchmarks.suite import main

pytestmark = [pytest.mark.timeout(300), pytest.mark.engine_device("cpu")]


def test_a_replica_killed_under_load_fails_no_stream(tmp_path):
    rc = main("parallel", parallel.CASES, [
        "failover", "--out", str(tmp_path), "--tiny", "--streams", "6", "--requests", "12",
        "--kill-at", "4", "--after-s", "3", "--", "--heartbeat-timeout", "2"])
    row = json.loads((tmp_path / "failover.json").read_text())
    assert rc == 0, row
    assert row["failed_streams"] == 0 and row["mismatched_streams"] == 0
    # the CPU in float32 repeats round A exactly, so there round B's identity is required
    assert row["control_mismatched"] == 0 and row["control_streams"] == row["requests"]
    assert row["serve_alive"] and row["restart_s"] is not None and row["restart_s"] > 0
    assert row["round_b_streams"] > row["requests"] / 2 and row["reference_failed"] == 0
    assert row["tok_s"]["after"] and row["tok_s"]["after"] > 0
    # read from the gateway's /metrics: how many streams the kill moved, by kind
    assert set(row["failovers"]) == {"resent", "resumed"}
    assert all(isinstance(n, int) and n >= 0 for n in row["failovers"].values())


def test_identity_counts_only_where_a_fault_free_repeat_is_identical():
    from benchmarks.bench_failover import passed

    ok = dict(failed_streams=0, serve_alive=True)
    assert passed({**ok, "control_mismatched": 0, "mismatched_streams": 0})
    assert not passed({**ok, "control_mismatched": 0, "mismatched_streams": 3})
    assert passed({**ok, "control_mismatched": 500, "mismatched_streams": 5640})
    assert not passed({**ok, "failed_streams": 1, "control_mismatched": 500})
    assert not passed({**ok, "serve_alive": False, "control_mismatched": 0,
                       "mismatched_streams": 0})
