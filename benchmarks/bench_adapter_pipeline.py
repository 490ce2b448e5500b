"""Adapter movement: disk -> host reads, AddAdapter, host -> slot swaps, and decode step
time with and without swaps, on a Llama-3-8B-shaped model (random bf16 weights) with
rank-16 adapters on all seven projections (84 MB each).

    python benchmarks/bench_adapter_pipeline.py --out DIR            # GPU, full model
    python benchmarks/bench_adapter_pipeline.py --out DIR --device cpu --layers 2

- read:   load_lora of one adapter into a reused host buffer (page-locked on CUDA),
          validation included; first read allocates, the later ones reuse.
- add:    Engine.add_adapter (what AddAdapter / LoadAdapter run), validation included.
- burst:  the engine's background reader bringing back every adapter at once (several
          threads): wall time per adapter.
- swap:   one host -> slot copy on the side stream, from issue to completion (host wall
          time, and device time between events).
- step:   decode steps of a batch over adapters already in slots, without and with one
          swap per step into a slot the batch does not use (the copy overlaps the step).
Targets (issue 20, on one H100/H200): add <= 50 ms, swap <= 5 ms, step with swaps within
5% of without. Logs and a JSON summary go to --out.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.llama8b import adapter_bytes, write_adapter, write_model_dir  # noqa: E402

RANK = 16


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def make_engine(model_dir: Path, args):
    from engine import Engine, EngineConfig

    cfg = EngineConfig(model=str(model_dir), device=args.device, dtype="bfloat16",
                       max_loras=args.slots, max_cpu_loras=max(args.adapters, args.slots),
                       max_lora_rank=RANK, load_format="dummy", max_num_seqs=args.batch,
                       max_num_batched_tokens=4096, num_kv_blocks=args.batch * 16 + 64,
                       max_model_len=512, enable_prefix_caching=False)
    return Engine(cfg)


def bench_read(model_dir: Path, paths: list[Path], device: torch.device, log) -> list[float]:
    from engine.lora import load_lora
    from engine.lora.host_buffers import HostBufferPool
    from engine.model.hf_config import ModelConfig

    mc = ModelConfig.from_dir(model_dir)
    pool = HostBufferPool(pin=device.type == "cuda")
    times = []
    for i, p in enumerate(paths * 2):
        t = time.perf_counter()
        w = load_lora(p, mc, RANK, dtype=torch.bfloat16, buffers=pool)
        times.append(time.perf_counter() - t)
        log(f"read {i}: {ms(times[-1])} ms ({w.nbytes / 1e6:.1f} MB, "
            f"{pool.num_allocations} buffers allocated, {pool.num_reuses} reused)")
        del w
    return times


def bench_add(engine, paths: list[Path], log) -> tuple[list[float], list[int]]:
    times, ids = [], []
    for i, p in enumerate(paths):
        t = time.perf_counter()
        ids.append(engine.add_adapter(f"a{i}", p))
        times.append(time.perf_counter() - t)
        log(f"add a{i}: {ms(times[-1])} ms")
    return times, ids


def bench_burst(engine, ids: list[int], log) -> float:
    """Drop every host copy, then let the background reader bring all back at once."""
    res = engine.adapters
    for aid in ids:
        res.host.drop(aid)
    t = time.perf_counter()
    for aid in ids:
        rec = engine.registry.get(aid)
        res.loader.submit(aid, rec.path, rec.version)
    done = 0
    while done < len(ids):
        res.loader.wait_any()
        for r in res.loader.collect():
            assert r.error is None, r.error
            res.add_host_copy(r.adapter_id, r.weights)
            done += 1
    per = (time.perf_counter() - t) / len(ids)
    log(f"burst: {len(ids)} adapters, {ms(per)} ms each")
    return per


def swap(engine, slot: int, weights, stream) -> None:
    """What residency does for a slot load: ordered after queued compute, on the side stream."""
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream())
    engine.lora_pool.load(slot, weights, stream=stream)


def bench_swap(engine, ids: list[int], device: torch.device, reps: int, log):
    stream = torch.cuda.Stream() if device.type == "cuda" else None
    wall, dev = [], []
    slot = engine.lora_pool.max_loras - 1
    for i in range(reps):
        w = engine.adapters.host.get(ids[i % len(ids)])
        sync(device)
        t = time.perf_counter()
        if stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            swap(engine, slot, w, stream)
            end.record(stream)
            end.synchronize()
            dev.append(start.elapsed_time(end) / 1e3)
        else:
            swap(engine, slot, w, stream)
        wall.append(time.perf_counter() - t)
    log(f"swap: wall {[ms(x) for x in wall]} ms; device {[ms(x) for x in dev]} ms")
    return wall, dev


def bench_steps(engine, ids: list[int], args, device: torch.device, log):
    """Mean decode step time over `args.steps` steps, without then with a swap per step."""
    from engine import SamplingParams

    used = ids[:args.slots - 1]          # the last slot is the swap target
    params = SamplingParams(max_tokens=4 * args.steps + 16, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 1000 for j in range(64)], params,
                           adapter=f"a{ids.index(used[i % len(used)])}")
    for _ in range(20):                  # prefill, then warm decode graphs
        engine.step()
    stream = torch.cuda.Stream() if device.type == "cuda" else None
    spare = [ids[-1]] + [a for a in ids if a not in used]
    slot = engine.lora_pool.max_loras - 1
    busy = {engine.slots.slot_of(a) for a in used}
    assert slot not in busy, "the swap target holds an adapter the batch uses"
    out = {}
    for mode in ("no_swap", "swap", "no_swap_again"):
        sync(device)
        t = time.perf_counter()
        for i in range(args.steps):
            if mode == "swap":
                swap(engine, slot, engine.adapters.host.get(spare[i % len(spare)]), stream)
            engine.step()
        sync(device)
        out[mode] = (time.perf_counter() - t) / args.steps
        log(f"steps {mode}: {ms(out[mode])} ms/step")
    engine.flush()
    for i in range(args.batch):
        engine.abort(f"r{i}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 32)")
    ap.add_argument("--adapters", type=int, default=6, help="distinct adapter files")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--swaps", type=int, default=10)
    args = ap.parse_args()
    if args.device == "cpu":
        args.batch = min(args.batch, 4)
        args.steps = min(args.steps, 4)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "adapter_pipeline.log", "w")

    def log(msg: str) -> None:
        print(msg, flush=True)
        logf.write(msg + "\n")

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_model_dir(Path(tmp) / "model", args.layers)
        cfg = json.loads((model_dir / "config.json").read_text())
        mb = adapter_bytes(cfg, RANK) / 1e6
        log(f"device {args.device}, {cfg['num_hidden_layers']} layers, adapter {mb:.1f} MB")
        paths = [write_adapter(Path(tmp) / f"a{i}", model_dir, RANK, seed=i)
                 for i in range(args.adapters)]
        read = bench_read(model_dir, paths, device, log)
        engine = make_engine(model_dir, args)
        try:
            add, ids = bench_add(engine, paths, log)
            burst = bench_burst(engine, ids, log)
            swap_wall, swap_dev = bench_swap(engine, ids, device, args.swaps, log)
            steps = bench_steps(engine, ids, args, device, log)
        finally:
            engine.close()
    med = statistics.median
    summary = {
        "device": args.device, "layers": cfg["num_hidden_layers"], "adapter_mb": round(mb, 1),
        "read_first_ms": ms(read[0]), "read_reused_ms": ms(med(read[len(paths):])),
        "add_ms": ms(med(add)), "add_max_ms": ms(max(add)), "burst_ms_per_adapter": ms(burst),
        "swap_wall_ms": ms(med(swap_wall)),
        "swap_device_ms": ms(med(swap_dev)) if swap_dev else None,
        "swap_gb_s": round(mb / 1e3 / med(swap_dev), 1) if swap_dev else None,
        "step_ms": ms(steps["no_swap"]), "step_swap_ms": ms(steps["swap"]),
        "step_ms_again": ms(steps["no_swap_again"]),
        "step_swap_ratio": round(steps["swap"] / steps["no_swap"], 3),
    }
    (out / "adapter_pipeline.json").write_text(json.dumps(summary, indent=2))
    rows = [("read (first, allocates)", summary["read_first_ms"], ""),
            ("read (buffer reused)", summary["read_reused_ms"], ""),
            ("AddAdapter", summary["add_ms"], "<= 50"),
            ("burst read, per adapter", summary["burst_ms_per_adapter"], ""),
            ("swap host->slot (wall)", summary["swap_wall_ms"], "<= 5"),
            ("swap host->slot (device)", summary["swap_device_ms"], "<= 5"),
            ("decode step, no swaps", summary["step_ms"], ""),
            ("decode step, one swap per step", summary["step_swap_ms"], "<= 1.05x")]
    log(f"\n{'what':<34}{'ms':>10}  target")
    for name, value, target in rows:
        log(f"{name:<34}{value if value is not None else '-':>10}  {target}")
    log(f"step with swaps / without: {summary['step_swap_ratio']}")
    logf.close()


if __name__ == "__main__":
    main()
