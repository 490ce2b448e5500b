"""The serving suite (`python -m benchmarks.serving`, benchmarks/bench_serving.py): the
workload it generates, and a tiny CPU run of the whole script (real service processes and the offline engine) checked for its report's fields,
not its speed."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # last: hides nothing installed
from benchmarks.serving.workload import (Record, make_workload, parse_lengths,  # noqa: E402
                                         parse_popularity, percentile, summarize)


def _workload(n=4000, names=("a", "b", "c", "d"), alpha=None, rate=None, seed=0):
    return make_workload(n, list(names), alpha, (4, 9), (2, 3), range(3, 50), rate, seed)


def test_workload_is_seeded_and_shaped():
    assert _workload(seed=1) == _workload(seed=1) != _workload(seed=2)
    wl = _workload(rate=50.0)
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(wl, wl[1:])]
    assert all(g >= 0 for g in gaps) and abs(len(wl) / wl[-1].arrival_s - 50.0) < 5.0
    assert all(4 <= len(r.prompt) <= 9 and 2 <= r.max_tokens <= 3 for r in wl)
    assert all(3 <= t < 50 for r in wl for t in r.prompt)
    assert all(r.arrival_s == 0.0 for r in _workload(rate=None))


def test_zipf_popularity():
    names = [f"n{i}" for i in range(20)]
    uniform = Counter(r.adapter for r in _workload(20000, names))
    assert max(uniform.values()) / min(uniform.values()) < 1.3
    zipf = Counter(r.adapter for r in _workload(20000, names, alpha=1.0)).most_common()
    top, second, last = zipf[0][1], zipf[1][1], zipf[-1][1]
    assert 1.6 < top / second < 2.4 and 12 < top / last < 30  # ~2 and ~20 for alpha 1


def test_parsers_and_summary():
    assert parse_lengths("7") == (7, 7) and parse_lengths("3-9") == (3, 9)
    assert parse_popularity("uniform") is None and parse_popularity("zipf:1.5") == 1.5
    for bad in ("0", "9-3", "x"):
        with pytest.raises(ValueError):
            parse_lengths(bad)
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0 and percentile([], 50) is None
    ok = Record(0, "a", 4, sent_s=0.0, first_s=0.5, end_s=1.0, tokens=3, gaps=[0.05, 0.05])
    slow = Record(1, "a", 4, sent_s=0.0, first_s=2.0, end_s=2.5, tokens=2, gaps=[0.5])
    failed = Record(2, None, 4, sent_s=0.0, error="UNAVAILABLE")
    s = summarize([ok, slow, failed], wall_s=2.0, slo_ttft_s=1.0, slo_itl_s=0.1)
    assert (s["completed"], s["errors"], s["output_tokens"]) == (2, {"UNAVAILABLE": 1}, 5)
    assert s["slo"]["attainment"] == pytest.approx(1 / 3)
    assert s["req_per_s"] == 1.0 and s["ttft_s"]["p50"] == pytest.approx(1.25)


@pytest.mark.timeout(300)
def test_tiny_run_writes_the_report(tmp_path):
    """Two adapter counts x two popularities on one service start, the first point run
    twice (--cold-first), adapters loaded 6 at a time, then the offline engine."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--tiny", "--out", str(out),
         "--concurrency", "3", "--adapters", "2,6", "--popularity", "uniform,zipf:1",
         "--num-requests", "8", "--load-workers", "6", "--cold-first", "--point-s", "60",
         "--", "--device", "cpu", "--max-loras", "2", "--max-cpu-loras", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "serving.json").read_text())
    meta, points = result["meta"], result["points"]
    assert meta["device"] == "cpu" and meta["engine_config"]["max_loras"] == 2
    assert [(p["adapters"], p["popularity"], p["round"]) for p in points] == [
        (2, "uniform", "first"), (2, "uniform", "steady"), (2, "zipf:1", None),
        (6, "uniform", None), (6, "zipf:1", None)]
    for p in points:
        assert p["concurrency"] == 3 and p["rate"] is None and p["requests"] == 8
        for system in ("service", "offline"):
            s = p[system]
            assert s["requests"] == s["completed"] == 8 and not s["errors"], (system, s)
            assert s["cut"] == s["unsent"] == 0
            assert s["req_per_s"] > 0 and s["output_tok_per_s"] > 0
            for key in ("ttft_s", "itl_s", "e2e_s"):
                assert set(s[key]) == {"p50", "p90", "p99", "mean"}
                assert 0 <= s[key]["p50"] <= s[key]["p90"] <= s[key]["p99"]
            assert 0.0 <= s["slo"]["attainment"] <= 1.0
            eng = s["engine"]
            assert set(eng) >= {"adapter_disk_reads", "adapter_slot_loads", "steps",
                                "mean_step_ms", "mean_batch"}, eng
            assert eng["steps"] > 0 and eng["mean_batch"] >= 1
            assert s["movement"]["swaps_per_s"] == pytest.approx(
                eng["adapter_slot_loads"] / s["wall_s"])
        assert p["service_over_offline"] > 0
        busy = p["service"]["cpu_busy"]  # from /proc, in 10 ms ticks: a short point may
        assert busy["engine"] > 0 and busy["gateway"] >= 0 and busy["client"] >= 0  # show 0
    # 6 adapters over 2 slots: the 6-adapter points move adapters in and out of slots
    assert all(p[s]["engine"]["adapter_slot_loads"] > 0 for p in points[3:]
               for s in ("service", "offline"))
    for system in ("service", "offline"):
        loads = meta["loads"][system]
        assert loads["adapters"] == 6 and loads["workers"] == 6
        assert loads["max_in_flight"] > 1, loads  # loads overlapped
        assert loads["latency_ms"]["p99"] >= loads["latency_ms"]["p50"] > 0
    assert meta["warmup_s"] == {} and set(meta["startup_s"]) == {"service", "offline"}
    assert meta["first_round_over_steady"] > 0 and meta["adapter_bytes"] > 0
    assert {"engine.log", "gateway.log", "control.log"} <= {f.name for f in (out / "logs").iterdir()}
    table = (out / "table.md").read_text()
    assert "| adapters | popularity | load |" in table
    assert "service: 6 adapters loaded in" in table and "first round after start" in table
    # rows are printed as points finish, before the final table
    assert proc.stdout.index("| 2 | uniform | 3 streams, first |") < proc.stdout.index("order: ")
    has_plots = importlib.util.find_spec("matplotlib") is not None
    assert (out / "adapters.png").exists() == has_plots


@pytest.mark.engine_device("cpu")  # its premise: no request finishes within the limits
def test_limits_bound_a_point(tmp_path):
    """No request is sent after send_s; what still runs drain_s later is cancelled: its
    tokens count towards throughput, its latency does not."""
    from benchmarks.serving.drivers import Limits, run_offline
    from loramux_engine import Engine, EngineConfig
    from tests.support.tiny import TinySpec, make_model

    # 3,000 tokens a request: no request can finish in the 0.8 s (400 did, on an idle CPU)
    model = make_model(tmp_path / "model", TinySpec(max_position_embeddings=4096))
    wl = make_workload(200, [None], None, (4, 8), (3000, 3000), range(3, 50), 50.0, 0)
    with Engine(EngineConfig(model=str(model), num_kv_blocks=4096)) as engine:
        records, wall = run_offline(engine, wl, None, Limits(send_s=0.5, drain_s=0.3))
        assert not engine.has_unfinished()
    s = summarize(records, wall, 1.0, 0.1)
    assert 0 < s["requests"] < 200 and s["unsent"] == 200 - s["requests"]
    assert s["cut"] == s["requests"] and s["completed"] == 0
    assert s["output_tokens"] > 0 and s["errors"] == {}
    assert 0.8 <= wall < 15.0  # about 0.8 s (1.0 s measured under load)


def test_synthetic_files_are_hard_links_of_a_few_weight_sets(tmp_path):
    from benchmarks.serving.files import prepare

    files = prepare(tmp_path, tiny=False, num_adapters=5, distinct=2, layers=1)
    assert files.dummy_weights and files.names == ("a0000", "a0001", "a0002", "a0003", "a0004")
    assert files.vocab == range(3, 128000)  # Llama 3's special ids start at 128000
    inodes = [(files.adapter_root / n / "adapter_model.safetensors").stat().st_ino
              for n in files.names]
    assert inodes[0] == inodes[2] == inodes[4] != inodes[1] == inodes[3]
    assert not (files.adapter_root / "a0000").is_symlink()


@pytest.mark.timeout(120)
def test_limits_bound_a_service_point(tmp_path):
    """The same bounds on the service path: streams still running at the limit are
    cancelled (the gateway aborts them) and the service serves on."""
    from benchmarks.serving.drivers import Limits, run_service
    from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
    from tests.support.tiny import TinySpec, make_model

    model = make_model(tmp_path / "model", TinySpec())
    wl = make_workload(50, [None], None, (4, 8), (1000, 1000), range(3, 50), None, 0)
    with Cluster(ClusterConfig(model=str(model), adapter_roots=(str(tmp_path),),
                               workdir=str(tmp_path / "run"),
                               engine_args=("--device", "cpu"))) as c:
        c.start()
        c.wait_ready()
        wait_serving(c.gateway_address)
        records, wall = run_service(c.gateway_address, wl, 4, Limits(send_s=0.5, drain_s=0.5))
        s = summarize(records, wall, 1.0, 0.1)
        assert s["requests"] == s["cut"] == 4 and s["unsent"] == 46 and s["errors"] == {}
        # about 1 s (0.5 s of sends, 0.5 s of drain); the bound leaves room for a loaded
        # machine, and streams left to their 1,000 tokens would also show in "cut"
        assert s["output_tokens"] > 0 and 1.0 <= wall < 15.0
        short = make_workload(2, [None], None, (4, 8), (4, 4), range(3, 50), None, 1)
        again, _ = run_service(c.gateway_address, short, 2, Limits(send_s=30, drain_s=30))
        assert all(r.end_s is not None and r.tokens == 4 and not r.cut for r in again)


def test_points_run_load_by_load_and_skip_what_cannot_run(capsys):
    """Points nest load > adapter count > popularity (one adapter: one popularity); a
    point needing more adapters than were loaded, or one that could not end before the
    deadline, is skipped and marked so."""
    import math
    import time
    from types import SimpleNamespace

    from benchmarks.serving.drivers import Limits
    from benchmarks.serving.phases import _points_to_run
    from benchmarks.serving.plan import Budget, Load, make_points, workload

    names = tuple(f"a{i}" for i in range(8))
    points = make_points([1, 8], [("uniform", None), ("zipf:1", 1.0)],
                         [Load(4.0, None), Load(None, 2)], lambda load: 3, names, (2, 3),
                         (2, 3), range(3, 50), 0, repeat_first=True)
    assert [(p["rate"], p["concurrency"], p["adapters"], p["popularity"], p["round"])
            for p in points] == [
        (4.0, None, 1, "uniform", "first"), (4.0, None, 1, "uniform", "steady"),
        (4.0, None, 8, "uniform", None), (4.0, None, 8, "zipf:1", None),
        (None, 2, 1, "uniform", None), (None, 2, 8, "uniform", None),
        (None, 2, 8, "zipf:1", None)]
    named = make_points([], [], [Load(None, 2)], lambda load: 3, names, (2, 3), (2, 3),
                        range(3, 50), 0, True, specs=[(5, "zipf:1"), (8, "uniform")],
                        during_loads=True)
    assert [(p["adapters"], p["popularity"], p["round"]) for p in named] == [
        (5, "zipf:1", "first"), (5, "zipf:1", "steady"), (5, "zipf:1", "during loads"),
        (8, "uniform", None)]
    wl = workload(named[1])
    assert len(wl) == 3 and {r.adapter for r in wl} <= set(names[:5]) and wl == workload(named[1])
    assert wl != workload(named[0])  # a repeat draws its own requests (no prefix-cache hits)
    args = SimpleNamespace(points=points, loaded=4)
    ran = [p["adapters"] for p in _points_to_run(args, "service", Budget(Limits(1, 1)))]
    assert ran == [1, 1, 1] and all(p["skipped"] == {"service": "adapters not loaded"}
                                    for p in points if p["adapters"] == 8)
    soon = Budget(Limits(send_s=10, drain_s=5), deadline=time.monotonic() + 12)
    assert list(_points_to_run(args, "offline", soon)) == []
    assert points[0]["skipped"] == {"offline": "deadline"}
    assert "offline: skipped (deadline) 1 adapters, uniform, 4 req/s" in capsys.readouterr().out
    unbounded = Budget(Limits(), deadline=time.monotonic() + 60)  # no worst case known
    assert unbounded.fits() and not Budget(Limits(), deadline=-math.inf).fits()


def test_window_summary_counts_what_happened_in_the_window():
    """Tokens by arrival time in [start, end), whatever request they belong to; TTFT of the
    requests sent in the window (one with no first token counts up to the stop, censored);
    ITL from the gaps between tokens that arrived in the window."""
    from benchmarks.serving.workload import summarize_window

    early = Record(0, "a", 4, sent_s=0.0, first_s=0.5, tokens=4,
                   chunks=[(0.5, 1), (1.5, 1), (2.5, 2)], gaps=[1.0, 0.5, 0.5])
    inside = Record(1, "a", 4, sent_s=1.2, first_s=1.4, end_s=2.9, tokens=3,
                    chunks=[(1.4, 1), (1.9, 1), (2.9, 1)], gaps=[0.5, 1.0])
    waiting = Record(2, "a", 4, sent_s=2.0, cut=True)
    after = Record(3, "a", 4, sent_s=3.5, first_s=3.6, tokens=1, chunks=[(3.6, 1)])
    s = summarize_window([early, inside, waiting, after], 1.0, 3.0, slo_ttft_s=0.5,
                         slo_itl_s=0.8, stopped_s=4.0)
    assert s["output_tokens"] == 1 + 2 + 3 and s["output_tok_per_s"] == 3.0
    assert (s["requests"], s["completed"], s["ttft_censored"], s["cut"]) == (2, 1, 1, 1)
    # TTFTs 0.2 (inside) and 2.0 (waiting: sent at 2.0, none by the stop at 4.0)
    assert (s["ttft_s"]["p50"], s["ttft_s"]["p99"]) == pytest.approx((1.1, 1.982))
    assert s["itl_s"]["p50"] == pytest.approx(0.5) and s["itl_s"]["p99"] == pytest.approx(1.0)
    assert s["e2e_s"]["p50"] == pytest.approx(1.7) and s["req_per_s"] == 0.5
    assert s["slo"]["attainment"] == 0.5  # inside (TTFT 0.2, mean gap 0.75); not waiting


def test_targets_and_first_round():
    from benchmarks.serving import report

    def pt(n, pop, tok, ttft99, round_=None):
        return {"adapters": n, "popularity": pop, "rate": None, "concurrency": 256,
                "round": round_, "service": {"output_tok_per_s": tok,
                                             "ttft_s": {"p50": 0.1, "p99": ttft99}}}
    points = [pt(5, "zipf:1", 900.0, 9.0, "first"), pt(5, "zipf:1", 1000.0, 1.0, "steady"),
              pt(5, "zipf:1", 10.0, 9.0, "during loads"), pt(32, "uniform", 1000.0, 1.0),
              pt(256, "uniform", 890.0, 1.0), pt(1000, "zipf:1", 970.0, 2.0),
              pt(2000, "zipf:1", 980.0, 2.5)]
    got = {(t["adapters"], t["popularity"]): (round(t["tok_ratio"], 3), t["met"])
           for t in report.targets(points)}
    assert got == {(256, "uniform"): (0.89, False), (1000, "zipf:1"): (0.97, True),
                   (2000, "zipf:1"): (0.98, False)}  # 2000: TTFT p99 2.5x
    assert report.first_over_steady(points[0], points[1]) == pytest.approx(0.9)
    assert report.first_over_steady(points[2], points[1], "service") == pytest.approx(0.01)
    # a repeat round is nobody's baseline: 1000 adapters compare with the steady 5
    assert report.vs_fewest(points[5], points) == (pytest.approx(0.97), pytest.approx(2.0))


@pytest.mark.timeout(300)
def test_tiny_adapters_round(tmp_path):
    """The adapters round's shape on the CPU: named points in order, the first one three
    times (first, steady, during loads), only its adapters loaded before it (the others in
    the background), every point measured in its window with the engine's counters and
    CPU at the window's edges."""
    out = tmp_path / "out"
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.serving", "--tiny", "--out", str(out),
         "--points", "2/zipf:1,6/uniform,6/zipf:1", "--concurrency", "3", "--cold-first",
         "--background-loads", "--no-offline", "--warm-s", "0.5", "--point-s", "2.5",
         "--drain-s", "3", "--load-workers", "4", "--", "--device", "cpu", "--max-loras", "2",
         "--max-cpu-loras", "4"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "serving.json").read_text())
    meta, points = result["meta"], result["points"]
    assert [(p["adapters"], p["popularity"], p["round"]) for p in points] == [
        (2, "zipf:1", "first"), (2, "zipf:1", "steady"), (2, "zipf:1", "during loads"),
        (6, "uniform", None), (6, "zipf:1", None)]
    assert len({p["seed"] for p in points}) == 5  # a repeat is not the same requests again
    for p in points:
        s = p["service"]
        assert s["window_s"] == [0.5, 2.5] and s["wall_s"] == 2.0 and not s["ran_out"]
        assert 2.5 <= s["run_s"] < 2.5 + 3 + 2
        assert s["output_tok_per_s"] > 0 and s["requests"] > 0 and not s["errors"]
        assert s["ttft_s"]["p99"] >= s["ttft_s"]["p50"] > 0 and s["itl_s"]["p50"] > 0
        assert s["engine"]["steps"] > 0 and s["cpu_busy"]["engine"] > 0
        assert s["movement"]["swaps_per_s"] >= 0 and p["loads_in_window"] >= 0
        assert ("service_from_start" in p) == (p["round"] in ("first", "steady"))
        assert 0 <= p["idle_after_s"] < 10  # the next point starts on an idle engine
    assert all(p["service"]["engine"]["adapter_slot_loads"] > 0 for p in points[3:])
    loads = meta["loads"]
    assert loads["service_one"]["adapters"] == loads["service_second"]["adapters"] == 1
    assert "service_first" not in loads  # the first point's 2 adapters: each loaded alone
    assert loads["service"]["adapters"] == 4 and loads["service"]["loads_per_s"] > 0
    assert meta["first_round_over_steady"] > 0 and meta["during_loads_over_steady"] > 0
    assert meta["windowed"] and meta["background_loads"] and meta["limits"]["warm_s"] == 0.5
    assert "one adapter alone: LoadAdapter" in proc.stdout
    assert "6 adapters loaded; this batch 4/4" in proc.stdout  # the background loads' line
    table = (out / "table.md").read_text()
    assert "first round after start / steady state" in table
    assert "the first point while the other adapters load / without loads" in table
    short = table[table.index("In short"):].splitlines()
    assert short[2].startswith("| adapters | popularity | round | start s | out tok/s |")
    # the start column is seconds after serving began: 0 here, 2 on a loaded machine
    assert re.match(r"\| 2 \| zipf:1 \| first \| \d+ \| ", short[4]) and len(short) == 4 + 5
    assert all(line.split(" | ")[-2] == "0" for line in short[4:])  # no request errors
