"""Loading many adapters: AddAdapter of one 84 MB Llama-3-8B rank-16 adapter, 16 at once,
and LoadAdapter through the service (control plane + engine process over ZMQ) for
thousands of adapters, with the cost of each block of loads, so growth with the number
of adapters shows.

    python -m benchmarks.adapters loads --out DIR                  # GPU machine, < 4 min
    python -m benchmarks.adapters loads --out DIR --service tiny   # a small CPU host

- add:     the engine's adapter operations alone (registry, host tier, reader: what
           Engine.add_adapter runs, without a model), real 84 MB adapters in PEFT layout
           (benchmarks/llama8b.py), host buffers page-locked on CUDA: AddAdapter one at a
           time (median), then BURST at once (read_adapter on BURST threads, each
           registered as it finishes, as the engine server does): wall time per adapter.
- service: `--adapters` LoadAdapter calls of new names through a control plane and an
           engine process (services/launcher.py), `--workers` in flight, names hard
           links of a few weight sets. `wide` (default): a 2-layer model as wide as
           Llama-3-8B with rank-256 adapters (84 MB each, like a 32-layer rank-16 one; the
           engine process on the CPU: loads are host work); `tiny`: the demo model and
           its adapters. `--max-cpu-loras` host copies (default 800, as serve resolves on
           an 80 GB H100): loads past it find the host tier full. Loads per second are
           reported per block of `--block` loads. No load starts after `--load-s`.
Logs and a JSON summary go to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import TeeLog  # noqa: E402
from benchmarks.llama8b import write_adapter, write_model_dir  # noqa: E402

RANK = 16
BURST = 16


def adapter_side(model_dir: Path, root: Path, device: str, capacity: int):
    """An AdapterService over the engine's own registry, host tier and reader for
    `model_dir` (its config only: no model is built; adds never touch a slot)."""
    from loramux_engine.adapters.host_cache import HostCache
    from loramux_engine.adapters.loader import DiskLoader
    from loramux_engine.adapters.pins import Pins
    from loramux_engine.adapters.registry import AdapterRegistry
    from loramux_engine.adapters.residency import AdapterResidency
    from loramux_engine.adapters.service import AdapterService
    from loramux_engine.adapters.slots import SlotTable
    from loramux_engine.assembly import adapter_reader
    from loramux_engine.config import EngineConfig
    from loramux_engine.lora.host_buffers import HostBufferPool
    from loramux_engine.parallel import TPGroup
    from loramux_core.adapter.plan import PlanCache
    from loramux_core.model.hf_config import ModelConfig

    cfg = EngineConfig(model=str(model_dir), device=device, dtype="bfloat16",
                       max_lora_rank=RANK, adapter_roots=(str(root),))
    buffers = HostBufferPool(pin=device == "cuda", spares=1)
    reader = adapter_reader(cfg, ModelConfig.from_dir(model_dir), TPGroup.single(), buffers,
                            PlanCache())
    pins = Pins(4)
    slots = SlotTable(4, pins)
    registry = AdapterRegistry()
    residency = AdapterResidency(registry, slots, HostCache(capacity, pins), DiskLoader(reader),
                                 None, torch.device(device))
    return AdapterService(registry, slots, pins, residency, None), buffers


def bench_add(tmp: Path, device: str, log, reps: int = 8) -> dict:
    model = write_model_dir(tmp / "llama8b")
    root = tmp / "adapters"
    paths = [write_adapter(root / f"w{i}", model, RANK, seed=i) for i in range(4)]
    service, buffers = adapter_side(model, root, device, capacity=4 * (reps + 2 * BURST))
    one, cpu = [], []
    for i in range(reps + 1):
        buffers.wait_spares()  # a spare buffer is ready, as between admin calls
        t, c = time.perf_counter(), time.process_time()
        service.add(f"one{i}", paths[i % len(paths)])
        one.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
        log(f"add one{i}: {one[-1] * 1e3:.1f} ms ({cpu[-1] * 1e3:.1f} ms of CPU)")
    bursts, burst_cpu = [], []
    with ThreadPoolExecutor(BURST) as pool:
        for round_ in range(2):  # the first allocates the host buffers
            t, c = time.perf_counter(), time.process_time()
            reads = [pool.submit(service.read, f"b{round_}_{i}", paths[i % len(paths)])
                     for i in range(BURST)]
            for fut in reads:
                service.register(fut.result())
            bursts.append((time.perf_counter() - t) / BURST)
            burst_cpu.append((time.process_time() - c) / BURST)
            log(f"burst {round_}: {BURST} at once, {bursts[-1] * 1e3:.1f} ms per adapter "
                f"({burst_cpu[-1] * 1e3:.1f} ms of CPU)")
    return {"add_ms": round(statistics.median(one[1:]) * 1e3, 1),
            "add_max_ms": round(max(one[1:]) * 1e3, 1),
            "add_cpu_ms": round(statistics.median(cpu[1:]) * 1e3, 1),
            "burst_ms_per_adapter": round(bursts[1] * 1e3, 1),
            "burst_cpu_ms_per_adapter": round(burst_cpu[1] * 1e3, 1),
            "burst_first_ms_per_adapter": round(bursts[0] * 1e3, 1)}


def service_files(tmp: Path, kind: str, n: int, distinct: int = 4):
    """(model dir, adapter root, names, rank): `n` adapter dirs, hard links of `distinct`
    weight sets."""
    from benchmarks.bench_adapter_pipeline import wide_model_dir
    from benchmarks.serving.files import link_adapters

    if kind == "tiny":
        from loramux_services.demo_model import DEMO_ADAPTERS, ensure_demo

        model = ensure_demo(tmp / "demo")
        weights, rank = [model / "adapters" / d for d in DEMO_ADAPTERS][:distinct], 16
    else:
        model, rank = wide_model_dir(tmp / "wide"), 256
        weights = [write_adapter(tmp / "wide_weights" / f"w{i}", model, rank, seed=i)
                   for i in range(distinct)]
    root = tmp / "service_adapters"
    return model, root, link_adapters(root, weights, n), rank


def bench_service(tmp: Path, args, log) -> dict:
    from loramux import AdminClient

    from loramux_services.launcher import Cluster, ClusterConfig

    model, root, names, rank = service_files(tmp, args.service, args.adapters)
    cfg = ClusterConfig(model=str(model), adapter_roots=(str(root),), workdir=str(tmp / "run"),
                        engine_args=("--device", "cpu", "--dtype", "bfloat16",
                                     "--load-format", "dummy", "--max-lora-rank", str(rank),
                                     "--max-loras", "4", "--max-cpu-loras",
                                     str(args.max_cpu_loras), "--max-num-seqs", "8",
                                     "--max-model-len", "256"),
                        control_args=("--max-lora-rank", str(rank)))
    stop_at = None
    done: list[float] = []

    def load(name: str) -> None:
        if time.perf_counter() > stop_at:
            return
        admin.load(name, name)
        done.append(time.perf_counter())

    with Cluster(cfg) as cluster:
        cluster.start("engine", "control")
        cluster.wait_ready("engine", "control", timeout_s=300)
        with AdminClient(cluster.control_address, timeout=600) as admin, \
                ThreadPoolExecutor(args.workers) as pool:
            t0 = time.perf_counter()
            stop_at = t0 + args.load_s
            list(pool.map(load, names))
            wall = time.perf_counter() - t0
    done.sort()
    blocks, start = [], t0
    for i in range(args.block, len(done) + 1, args.block):
        end = done[i - 1]
        blocks.append(round(args.block / (end - start), 1))
        log(f"loads {i - args.block + 1}-{i}: {blocks[-1]} per second")
        start = end
    rate = len(done) / (done[-1] - t0) if done else 0.0
    log(f"service: {len(done)} of {len(names)} adapters loaded in {wall:.1f} s "
        f"({rate:.1f} per second, {args.workers} in flight)")
    return {"model": args.service, "adapters": len(names), "loaded": len(done),
            "wall_s": round(wall, 1), "loads_per_s": round(rate, 1),
            "loads_per_s_by_block": blocks, "block": args.block,
            "max_cpu_loras": args.max_cpu_loras, "workers": args.workers}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the add part's host buffers are meant for (cuda: pinned)")
    ap.add_argument("--service", choices=("wide", "tiny", "none"), default="wide")
    ap.add_argument("--adapters", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=32, help="LoadAdapter calls in flight")
    ap.add_argument("--max-cpu-loras", type=int, default=800)
    ap.add_argument("--block", type=int, default=250)
    ap.add_argument("--load-s", type=float, default=150.0)
    ap.add_argument("--no-add", action="store_true")
    args = ap.parse_args()
    out = Path(args.out)
    log = TeeLog(out / "adapter_loads.log")

    log(f"device {args.device}, torch threads {torch.get_num_threads()}")
    summary: dict = {"device": args.device}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.no_add:
            summary["add"] = bench_add(Path(tmp), args.device, log)
        if args.service != "none":
            summary["service"] = bench_service(Path(tmp), args, log)
    (out / "adapter_loads.json").write_text(json.dumps(summary, indent=2))
    log("\nwhat                                           value")
    if "add" in summary:
        a = summary["add"]
        log(f"AddAdapter, 84 MB, one at a time (ms)          {a['add_ms']}  (max "
            f"{a['add_max_ms']}; CPU {a['add_cpu_ms']})")
        log(f"AddAdapter, {BURST} at once, per adapter (ms)      {a['burst_ms_per_adapter']}  "
            f"(CPU {a['burst_cpu_ms_per_adapter']})")
    if "service" in summary:
        s = summary["service"]
        log(f"LoadAdapter through the service, loads/s       {s['loads_per_s']}  "
            f"({s['loaded']} of {s['adapters']} {s['model']} adapters, "
            f"max_cpu_loras {s['max_cpu_loras']})")
        log(f"  per block of {s['block']}: {s['loads_per_s_by_block']}")
    log.close()


if __name__ == "__main__":
    main()
