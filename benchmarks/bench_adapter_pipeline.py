"""Adapter movement: disk -> host reads, AddAdapter (one, and bursts in parallel), host ->
slot swaps, and decode step time with and without swaps, on a Llama-3-8B-shaped model
(random bf16 weights) with rank-16 adapters on all seven projections (84 MB each).

    python -m benchmarks.adapters pipeline --out DIR                 # GPU, < 4 minutes
    python -m benchmarks.adapters pipeline --out DIR --device cpu    # CPU (2 layers for
                                                                          # the engine parts)

- breakdown: one AddAdapter of the full 84 MB adapter, stage by stage (read into a reused
          buffer, the chunked hash on threads, header parse and plan, the one-pass
          conversion into the host buffer, the whole-buffer finiteness check; each alone)
          and end to end (stages overlap: the hash runs beside the conversion), and the
          control plane's own full validation (what RegisterAdapter still runs).
- control plane: LoadAdapter over real gRPC through a control plane and an engine
          process (services/launcher.py; the engine process on the CPU, so this part
          measures the admin path, reads and conversion, not the GPU), new names, one at
          a time and 16 at once, beside the engine's own read of the same adapter (a
          2-layer model as wide as Llama-3-8B with rank-256 adapters: also 84 MB).
- read:   load_lora of one adapter into a reused host buffer (page-locked on CUDA),
          validation included; first read allocates, the later ones reuse.
- add:    Engine.add_adapter (what AddAdapter / LoadAdapter run), validation included.
- burst:  16 AddAdapters at once: read_adapter on 16 threads (what the engine server's
          reader threads do), each registered as it finishes: wall time per adapter.
- swap:   one host -> slot copy through the engine's copier (its side stream), from issue
          to completion (host wall time, and device time between events), and the copies
          it queues.
- step:   decode steps of a batch over adapters already in slots, without swaps, with
          one swap per step and with 4: each step, an adapter the batch does not use is
          prefetched into a slot the way the engine brings in a waiting request's adapter
          (residency prefetch, evicting an adapter without running requests; benchmarks/
          swap_steps.py); each swap is counted. The modes alternate in chunks of 10
          steps, so the step time's drift (contexts grow) hits each alike.

    python -m benchmarks.adapters pipeline --out DIR --quick   # swaps and steps only

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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import TeeLog  # noqa: E402
from benchmarks.llama8b import adapter_bytes, write_adapter, write_model_dir  # noqa: E402
from benchmarks.swap_steps import SwapIn, time_interleaved  # noqa: E402

RANK = 16
BURST = 16


def ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, reps: int = 5) -> float:
    """Median seconds of `reps` calls (after one warm-up call)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def make_engine(model_dir: Path, args):
    from loramux_engine import Engine, EngineConfig

    cfg = EngineConfig(model=str(model_dir), device=args.device, dtype="bfloat16",
                       max_loras=args.slots,
                       max_cpu_loras=max(args.adapters, args.slots) * 2 + BURST + SPARES,
                       max_lora_rank=RANK, load_format="dummy", max_num_seqs=args.batch,
                       max_num_batched_tokens=4096, num_kv_blocks=args.batch * 32 + 64,
                       max_model_len=512, enable_prefix_caching=False)
    return Engine(cfg)


def read_raw(path: Path, into: memoryview) -> int:
    """open + read the weights file into `into` (no hash): the floor of a read."""
    import os

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got, size = 0, os.fstat(fd).st_size
        while got < size:
            got += os.readv(fd, [into[got:got + (8 << 20)]])
        return got
    finally:
        os.close(fd)


def bench_breakdown(model_dir: Path, path: Path, device: torch.device, log) -> dict:
    """One AddAdapter's read of the full adapter, stage by stage, each alone (median of 5),
    then end to end; and the control plane's own validation (services/control)."""
    from loramux_core.file_digest import HASH_THREADS, file_digest
    from loramux_core.safe_files import AdapterRoots
    from loramux_engine.lora import load_lora
    from loramux_engine.lora.host_buffers import HostBufferPool
    from loramux_core.adapter.plan import WEIGHTS_NAME, plan_adapter
    from loramux_core.adapter.safetensors_buffer import parse_header
    from loramux_engine.lora.weights import _all_within_bounds, weights_from_plan
    from loramux_core.model.hf_config import ModelConfig
    from loramux_services.control.main import make_validator

    mc = ModelConfig.from_dir(model_dir)
    pool = HostBufferPool(pin=device.type == "cuda")
    size = (path / WEIGHTS_NAME).stat().st_size
    scratch = pool.scratch.acquire(size)
    into = memoryview(scratch.data.numpy())
    data = into[:size]
    read_raw(path / WEIGHTS_NAME, into)
    plan = plan_adapter(path, mc, RANK)
    w = weights_from_plan(plan, mc, dtype=torch.bfloat16, buffers=pool)
    flat = w.buffer.data[:w.buffer_bytes].view(torch.bfloat16)
    validate = make_validator(str(model_dir), RANK, AdapterRoots([str(path.parent)]))
    out = {
        "open_read": timed(lambda: read_raw(path / WEIGHTS_NAME, into)),
        f"hash ({HASH_THREADS} threads)": timed(lambda: file_digest(data, HASH_THREADS)),
        "hash (1 thread)": timed(lambda: file_digest(data, 1)),
        "parse header": timed(lambda: parse_header(data, "w")),
        "read+hash+parse+plan": timed(lambda: plan_adapter(path, mc, RANK).version),
        "finiteness check": timed(lambda: _all_within_bounds(flat)),
        "convert+cast+scale+check into host buffer": timed(
            lambda: weights_from_plan(plan, mc, dtype=torch.bfloat16, buffers=pool)),
        "load_lora end to end": timed(
            lambda: load_lora(path, mc, RANK, dtype=torch.bfloat16, buffers=pool)),
        "control plane validation": timed(lambda: validate(path.name)),
    }
    for name, sec in out.items():
        log(f"breakdown {name}: {ms(sec)} ms")
    return {k: ms(v) for k, v in out.items()}


def wide_model_dir(path: Path, layers: int = 2) -> Path:
    """A Llama-3-8B-wide model of `layers` layers and a 1,024-token vocabulary: small
    enough for a second engine process, while its rank-256 adapters are 84 MB like a
    32-layer rank-16 one (the read, hash and conversion cost the same bytes)."""
    import json as _json

    from tokenizers import Tokenizer, models, pre_tokenizers

    from benchmarks.llama8b import LLAMA3_8B

    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(LLAMA3_8B, num_hidden_layers=layers, vocab_size=1024, bos_token_id=1,
               eos_token_id=2)
    (path / "config.json").write_text(_json.dumps(cfg, indent=2))
    (path / "generation_config.json").write_text(_json.dumps({"eos_token_id": 2}))
    tok = Tokenizer(models.WordLevel(vocab={f"t{i}": i for i in range(1024)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def bench_control_plane(tmp: Path, device: torch.device, log, burst: int = BURST) -> dict:
    """LoadAdapter over real gRPC through a control plane and an engine process (services/
    launcher.py), 84 MB adapters of new names: one at a time, then `burst` at once; and
    the engine's own read of the same adapter, so the difference is what the control
    plane adds."""
    import asyncio

    from loramux.aio import AsyncAdminClient

    from loramux_engine.lora import load_lora
    from loramux_engine.lora.host_buffers import HostBufferPool
    from loramux_core.model.hf_config import ModelConfig
    from loramux_services.launcher import Cluster, ClusterConfig

    rank = 256
    model = wide_model_dir(tmp / "wide")
    roots = tmp / "wide_adapters"
    paths = [write_adapter(roots / f"w{i}", model, rank, seed=i) for i in range(4)]
    mc = ModelConfig.from_dir(model)
    pool = HostBufferPool(pin=device.type == "cuda")
    read = timed(lambda: load_lora(paths[0], mc, rank, dtype=torch.bfloat16, buffers=pool))
    cfg = ClusterConfig(model=str(model), adapter_roots=(str(roots),), workdir=str(tmp / "run"),
                        engine_args=("--device", device.type, "--dtype", "bfloat16",
                                     "--load-format", "dummy", "--max-lora-rank", str(rank),
                                     "--max-loras", "4", "--max-cpu-loras", str(3 * burst),
                                     "--max-num-seqs", "8", "--max-model-len", "256"),
                        control_args=("--max-lora-rank", str(rank)))
    cluster = Cluster(cfg)

    async def loads() -> tuple[list[float], float]:
        async with AsyncAdminClient(cluster.control_address) as admin:
            one = []
            for i in range(6):
                t = time.perf_counter()
                await admin.load(f"one{i}", paths[i % len(paths)].name)
                one.append(time.perf_counter() - t)
            t = time.perf_counter()
            await asyncio.gather(*(admin.load(f"burst{i}", paths[i % len(paths)].name)
                                   for i in range(burst)))
            return one[1:], (time.perf_counter() - t) / burst

    cluster.start("engine", "control")
    try:
        cluster.wait_ready("engine", "control", timeout_s=300)
        one, per = asyncio.run(loads())
    finally:
        cluster.close()
    out = {"engine read (load_lora)": read, "LoadAdapter, one at a time": statistics.median(one),
           f"LoadAdapter, {burst} at once, per adapter": per}
    out["control plane + engine server overhead"] = out["LoadAdapter, one at a time"] - read
    for name, sec in out.items():
        log(f"control plane {name}: {ms(sec)} ms")
    return {k: ms(v) for k, v in out.items()}


def bench_read(model_dir: Path, paths: list[Path], device: torch.device, log) -> list[float]:
    from loramux_engine.lora import load_lora
    from loramux_engine.lora.host_buffers import HostBufferPool
    from loramux_core.model.hf_config import ModelConfig

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


def bench_burst(engine, paths: list[Path], log) -> list[float]:
    """BURST AddAdapters at once, twice (the first allocates host buffers): reads on
    BURST threads, each registered on this thread as it finishes; wall time per adapter."""
    out = []
    with ThreadPoolExecutor(BURST) as pool:
        for round_ in range(2):
            t = time.perf_counter()
            reads = [pool.submit(engine.read_adapter, f"burst{i}", paths[i % len(paths)])
                     for i in range(BURST)]
            for fut in reads:
                engine.register_adapter(fut.result())
            out.append((time.perf_counter() - t) / BURST)
            log(f"burst {round_}: {BURST} adapters at once, {ms(out[-1])} ms each")
    return out


def swap(engine, slot: int, weights) -> None:
    """One host -> slot copy through the engine's copier (its side stream on CUDA), into a
    slot no step reads."""
    engine.adapters.copier.queue(slot, -1, lambda: engine.lora_pool.load(slot, weights))


def wait_pinned(engine, ids: list[int], device: torch.device, timeout_s: float = 60.0) -> None:
    """Host copies are page-locked in the background after a load (engine/lora/
    host_buffers.py): swaps are timed from pinned copies, as in steady serving."""
    deadline = time.monotonic() + timeout_s
    copies = [engine.adapters.host.get(a) for a in ids]
    while device.type == "cuda" and not all(w is None or w.pinned for w in copies):
        assert time.monotonic() < deadline, "host copies not page-locked in time"
        time.sleep(0.01)


def bench_swap(engine, ids: list[int], device: torch.device, reps: int, log):
    wait_pinned(engine, ids, device)
    stream = getattr(engine.adapters.copier, "stream", None)
    wall, dev, copies = [], [], []
    slot = engine.lora_pool.max_loras - 1
    for i in range(reps):
        before = engine.lora_pool.num_copies
        w = engine.adapters.host.get(ids[i % len(ids)])
        sync(device)
        t = time.perf_counter()
        if stream is not None:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            swap(engine, slot, w)
            end.record(stream)
            end.synchronize()
            dev.append(start.elapsed_time(end) / 1e3)
        else:
            swap(engine, slot, w)
        wall.append(time.perf_counter() - t)
        copies.append(engine.lora_pool.num_copies - before)
    log(f"swap: wall {[ms(x) for x in wall]} ms; device {[ms(x) for x in dev]} ms; "
        f"copies {copies}")
    return wall, dev, copies


SPARES = 2   # adapters swapped in beyond the free slots (every swap then evicts)
MULTI = 4    # swaps per step of the "swap_x4" mode (when the batch leaves that many slots)


def step_modes(free_slots: int) -> list[tuple[str, int]]:
    """(mode, swaps per step) of the modes the free slots allow."""
    modes = [("no_swap", 0), ("swap", 1), ("swap_x4", MULTI)]
    return [(m, n) for m, n in modes if n <= free_slots]


def bench_steps(engine, ids: list[int], paths: list[Path], args, device: torch.device, log):
    """Mean decode step time without swaps and with swaps through the engine's residency
    path (`SwapIn`): one per step, and MULTI per step where the batch leaves enough slots
    free. The modes are interleaved in chunks (benchmarks/swap_steps.py:
    `time_interleaved`), so that the slow drift of the step time (every context grows a
    token per step) weighs on each alike."""
    from loramux_engine import SamplingParams

    used = ids[:args.slots - 1]
    chunk = min(10, args.steps)
    rounds = max(2, args.steps // chunk)
    # every step below, with room to spare: no request finishes while steps are timed
    steps = 20 + args.slots + MULTI + SPARES + 3 * rounds * chunk + 16
    assert 64 + steps <= engine.max_model_len, f"{steps} steps: lower --steps"
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(f"r{i}", [1 + (i * 7 + j) % 1000 for j in range(64)], params,
                           adapter=f"a{ids.index(used[i % len(used)])}")
    for _ in range(20):                  # prefill, then warm decode graphs
        engine.step()
    free = args.slots - len(engine.scheduler.running_adapters())
    modes = step_modes(free)
    spares = [engine.add_adapter(f"spare{i}", paths[i % len(paths)])
              for i in range(free + max(n for _, n in modes) + SPARES)]
    wait_pinned(engine, spares, device)
    swap = SwapIn(engine, spares)
    for _ in range(len(spares)):         # each spare once through a slot, then the timing
        swap()
        engine.step()
    out = time_interleaved(engine, swap, modes, chunk, rounds, log)
    engine.flush()
    for i in range(args.batch):
        engine.abort(f"r{i}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of the engine's model (default 32; 2 on the CPU); "
                         "the breakdown always uses the full 32-layer adapter")
    ap.add_argument("--adapters", type=int, default=6, help="distinct adapter files")
    ap.add_argument("--slots", type=int, default=8,
                    help="max_loras; the batch uses min(adapters, slots - 1) of them")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30,
                    help="decode steps timed per mode (in chunks of 10, modes interleaved)")
    ap.add_argument("--swaps", type=int, default=10)
    ap.add_argument("--swap-only", action="store_true",
                    help="only adapter adds, swaps and steps (skip the AddAdapter breakdown, "
                         "the control plane, reads and bursts)")
    ap.add_argument("--quick", action="store_true",
                    help="--swap-only with fewer swaps: the steps with and without swaps, "
                         "in about a minute on a GPU with start-up")
    ap.add_argument("--breakdown-only", action="store_true",
                    help="only the AddAdapter breakdown and the control plane (no engine)")
    ap.add_argument("--no-control-plane", action="store_true",
                    help="skip LoadAdapter through a control plane and engine process")
    args = ap.parse_args()
    started = time.perf_counter()
    if args.quick:
        args.swap_only = True
        args.steps, args.swaps = 60, 5
        args.slots = max(args.slots, args.adapters + MULTI + 2)  # room for swap_x4
    if args.device == "cpu":
        args.batch = min(args.batch, 4)
        args.steps = min(args.steps, 4)
        args.layers = args.layers or 2
    out = Path(args.out)
    log = TeeLog(out / "adapter_pipeline.log")

    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        full_dir = write_model_dir(Path(tmp) / "full")
        mb_full = adapter_bytes(json.loads((full_dir / "config.json").read_text()), RANK) / 1e6
        log(f"device {args.device}, torch threads {torch.get_num_threads()}, full adapter "
            f"{mb_full:.1f} MB")
        summary = {"device": args.device, "adapter_mb_full": round(mb_full, 1)}
        if not args.swap_only:
            summary["breakdown_ms"] = bench_breakdown(
                full_dir, write_adapter(Path(tmp) / "full_a", full_dir, RANK), device, log)
        # the control plane's engine process runs on the CPU: see the docstring
        if not args.no_control_plane and not args.swap_only:
            summary["control_plane_ms"] = bench_control_plane(Path(tmp), torch.device("cpu"),
                                                              log)
        if not args.breakdown_only:
            summary.update(engine_parts(Path(tmp), args, device, log))
    (out / "adapter_pipeline.json").write_text(json.dumps(summary, indent=2))
    table(summary, log)
    log(f"total {time.perf_counter() - started:.1f} s")
    log.close()


def engine_parts(tmp: Path, args, device: torch.device, log) -> dict:
    model_dir = write_model_dir(tmp / "model", args.layers)
    cfg = json.loads((model_dir / "config.json").read_text())
    mb = adapter_bytes(cfg, RANK) / 1e6
    log(f"engine: {cfg['num_hidden_layers']} layers, adapter {mb:.1f} MB")
    paths = [write_adapter(tmp / f"a{i}", model_dir, RANK, seed=i) for i in range(args.adapters)]
    med = statistics.median
    summary = {"layers": cfg["num_hidden_layers"], "adapter_mb": round(mb, 1)}
    if not args.swap_only:
        read = bench_read(model_dir, paths, device, log)
        summary.update(read_first_ms=ms(read[0]), read_reused_ms=ms(med(read[len(paths):])))
    engine = make_engine(model_dir, args)
    try:
        add, ids = bench_add(engine, paths, log)
        summary.update(add_ms=ms(med(add)), add_max_ms=ms(max(add)))
        if not args.swap_only:
            burst = bench_burst(engine, paths, log)
            summary.update(burst_first_ms_per_adapter=ms(burst[0]),
                           burst_ms_per_adapter=ms(burst[1]))
        swap_wall, swap_dev, copies = bench_swap(engine, ids, device, args.swaps, log)
        steps = bench_steps(engine, ids, paths, args, device, log)
    finally:
        engine.close()
    return summary | {
        "swap_wall_ms": ms(med(swap_wall)),
        "swap_device_ms": ms(med(swap_dev)) if swap_dev else None,
        "swap_gb_s": round(mb / 1e3 / med(swap_dev), 1) if swap_dev else None,
        "copies_per_swap": med(copies),
        "step_ms": ms(steps["no_swap"]), "step_swap_ms": ms(steps["swap"]),
        "step_swap_ratio": round(steps["swap"] / steps["no_swap"], 3),
        f"step_swap_x{MULTI}_ms": ms(steps["swap_x4"]) if "swap_x4" in steps else None,
    }


def table(summary: dict, log) -> None:
    if "breakdown_ms" in summary:
        log(f"\nAddAdapter of one {summary['adapter_mb_full']} MB adapter, stage by stage "
            f"({summary['device']}):")
        for name, value in summary["breakdown_ms"].items():
            log(f"  {name:<44}{value:>10} ms")
    if "control_plane_ms" in summary:
        log("LoadAdapter over gRPC, control plane + engine process (on the CPU), 84 MB "
            "adapters of new names:")
        for name, value in summary["control_plane_ms"].items():
            log(f"  {name:<44}{value:>10} ms")
    if "step_ms" not in summary:
        return
    get = summary.get
    rows = [("read (first, allocates)", get("read_first_ms"), ""),
            ("read (buffer reused)", get("read_reused_ms"), ""),
            ("AddAdapter", summary["add_ms"], "<= 50"),
            (f"AddAdapter, {BURST} at once, per adapter", get("burst_ms_per_adapter"), ""),
            ("  same, first burst (allocates)", get("burst_first_ms_per_adapter"), ""),
            ("swap host->slot (wall)", summary["swap_wall_ms"], "<= 5"),
            ("swap host->slot (device)", summary["swap_device_ms"], "<= 5"),
            ("copies per swap", summary["copies_per_swap"], ""),
            ("decode step, no swaps", summary["step_ms"], ""),
            ("  one swap per step", summary["step_swap_ms"], ""),
            (f"  {MULTI} swaps per step", get(f"step_swap_x{MULTI}_ms"), ""),
            ]
    log(f"\n{summary['layers']} layers, adapter {summary['adapter_mb']} MB")
    log(f"{'what':<46}{'ms':>10}  target")
    for name, value, target in rows:
        log(f"{name:<46}{value if value is not None else '-':>10}  {target}")
    log(f"step with swaps / without: {summary['step_swap_ratio']}  (target <= 1.05)")


if __name__ == "__main__":
    main()
