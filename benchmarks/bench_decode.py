"""Engine decode benchmark on a Llama-3-8B-shaped model with random bf16 weights, against
the memory-bandwidth floor and, in the same run, Hugging Face transformers + PEFT.

    python -m benchmarks.decode --out DIR [--quick] [--no-hf]

Modes: "base" (no adapter), "one" (one rank-16 adapter for every request, the engine's
defaults), "distinct" (one rank-16 adapter per request, on all seven projections),
"dora" (one rank-16 DoRA adapter for every request: the row factors after each group),
"head" (one adapter with LoRA on lm_head too: the vocabulary-wide expand). The heap is
frozen once the engine is built, as the engine server does after its warm-up
(loramux_core/gc_heap.py); the collections inside each timed window are reported.
Distinct adapters are registered from a few adapter files under different names: each
name gets its own id, slot and device copy, so a step reads every adapter's A/B
separately exactly as with distinct files, without writing gigabytes of adapter files
first.
--mixed-paths table,rule runs the mixed modes ("distinct", "d64": 64 adapters round robin)
once per choice of kernels/lora/plan.py FORCED: "rule" (the engine's: the GPU's
table and its rows-per-adapter rule), "table" (the table alone, the choice before that
rule), "tokens", "segments"; rows of a choice other than "rule" are labelled
"MODE/mp-CHOICE", so one run gives before and after.
--lora-gemm off,rows,cols,all runs every mode once per setting of engine/lora/batch.py
FUSED_LORA_GEMM (one adapter for every row inside the base GEMMs, engine/lora/fused.py:
o's and down's shrink; and q/k/v's and gate/up's expand; and o's and down's expand in
the norm after them), on the same engine; rows of a setting other
than the first are labelled "MODE/lg-SETTING" (after any other suffix), and so are the
profile files.
"""
from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import device_events  # noqa: E402
from benchmarks.gc_clock import GcClock  # noqa: E402
from benchmarks.llama8b import (LLAMA3_8B, adapter_bytes, kv_bytes, weight_bytes,  # noqa: E402
                                write_adapter, write_model_dir)

RANK = 16
NUM_ADAPTER_FILES = 4


def copy_bandwidth(gib: int = 4) -> float:
    """Bytes/s of a large device-to-device copy, counting bytes read plus written."""
    n = gib * (1 << 30) // 2
    src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); dst.copy_(src); e.record(); torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def make_engine(model_dir: Path, max_loras: int, max_batch: int, enforce_eager: bool,
                prompt_len: int, steps: int, async_scheduling: bool | None = None):
    from loramux_engine import Engine, EngineConfig

    per_seq = -(-(prompt_len + steps + 32) // 16)
    cfg = EngineConfig(model=str(model_dir), device="cuda", dtype="bfloat16",
                       max_loras=max(1, max_loras), max_lora_rank=RANK, load_format="dummy",
                       max_num_seqs=max_batch, max_num_batched_tokens=8192,
                       num_kv_blocks=max_batch * per_seq + 64, max_model_len=1024,
                       enable_prefix_caching=False, enforce_eager=enforce_eager,
                       async_scheduling=async_scheduling)
    eng = Engine(cfg)
    # Host copies by path: NUM_ADAPTER_FILES files are read once, each name still gets its
    # own id, slot and device copy (what a decode step reads). Benchmark-only shortcut.
    loader = eng.adapters.loader
    loader._load_weights = functools.lru_cache(maxsize=None)(loader._load_weights)
    return eng


class HostTimer:
    """Seconds spent in the engine's host-side step phases (schedule, input fill,
    update), accumulated per step by wrapping the bound methods of this engine."""

    def __init__(self, eng):
        self.acc = {"schedule": 0.0, "fill": 0.0, "update": 0.0}
        self._wrap(eng.scheduler, "schedule", "schedule")
        self._wrap(eng.scheduler, "update", "update")
        if eng.runner.graphs is not None:
            self._wrap(eng.runner.graphs.staging, "fill", "fill")
        else:
            self._wrap(eng.runner, "prepare_inputs", "fill")

    def _wrap(self, obj, attr: str, key: str) -> None:
        fn = getattr(obj, attr)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.acc[key] += time.perf_counter() - t0
        setattr(obj, attr, timed)

    def take(self) -> dict[str, float]:
        out = dict(self.acc)
        for k in self.acc:
            self.acc[k] = 0.0
        return out


_DEFAULT_PATH: dict = {}


def select_lora_gemm(eng, setting: str) -> None:
    """engine/lora/batch.py FUSED_LORA_GEMM = setting ("default": as the engine ships);
    captured graphs are dropped when it changes (a uniform graph captures the GEMMs over
    the spare rows and columns or not)."""
    from loramux_engine.lora import batch
    if "gemm" not in _DEFAULT_PATH:
        _DEFAULT_PATH["gemm"] = batch.FUSED_LORA_GEMM
    want = _DEFAULT_PATH["gemm"] if setting == "default" else setting
    if batch.FUSED_LORA_GEMM != want:
        batch.FUSED_LORA_GEMM = want
        if eng.runner.graphs is not None:
            eng.runner.graphs.release()


def strided_weight_copies(model) -> str:
    """Whether the base matmul of gate_up_proj, whose `weight` is a strided view of
    [W | B] (engine/model/layers.py), copies it first: the device memory a matmul of 64
    rows takes beyond its output, against the weight's size."""
    lin = model.layers[0].mlp.gate_up_proj
    x = torch.randn(64, lin.in_features, dtype=lin.weight.dtype, device=lin.weight.device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    y = lin.matmul(x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before - y.nbytes
    weight = lin.weight.numel() * lin.weight.element_size()
    return (f"gate_up's strided weight (row stride {lin.weight.stride(0)}) "
            f"{'COPIED' if extra >= weight else 'not copied'} by its matmul "
            f"({extra / 2**20:.1f} MiB beyond the output, weight {weight / 2**20:.0f} MiB)")


def gemm_label(label: str, setting: str, settings: list[str]) -> str:
    return label if setting == settings[0] else f"{label}/lg-{setting}"


MIXED_MODES = ("distinct", "d64")         # modes whose steps take the mixed LoRA path
MIXED_PATHS = {"rule": None, "table": "table", "tokens": "tokens", "segments": "mixed"}


def select_mixed_path(eng, path: str) -> None:
    """kernels/lora/plan.py FORCED = MIXED_PATHS[path]; captured graphs are dropped
    when it changes."""
    from loramux_kernels.lora import plan
    if plan.FORCED != MIXED_PATHS[path]:
        plan.FORCED = MIXED_PATHS[path]
        if eng.runner.graphs is not None:
            eng.runner.graphs.release()


def mixed_label(label: str, path: str) -> str:
    return label if path == "rule" else f"{label}/mp-{path}"


def decode_graph(eng, adapters: list[str | None]):
    """The captured greedy decode graph that rows on `adapters` replay (None: none yet),
    looked up by the rows' own slots (the key's DoRA / lm_head bits depend on them)."""
    from loramux_engine.scheduler import ScheduledRequest
    slot = {a: eng.slots.slot_of(eng.registry.resolve(a)) for a in set(adapters) if a}
    sched = [ScheduledRequest(None, 0, 1, (), slot[a] if a else -1, True) for a in adapters]
    return eng.runner.graphs.graph_for(eng.runner.graphs.key_for(sched, greedy=True))


def mode_adapters(mode: str, b: int, names: list[str]) -> list[str | None]:
    return {"base": [None] * b, "one": [names[0]] * b, "distinct": names[:b],
            "d64": [names[i % 64] for i in range(b)], "dora": ["dora"] * b,
            "head": ["head"] * b}[mode]


def graph_replay_s(eng, adapters: list[str | None], reps: int = 20) -> float:
    """Median GPU time of one replay of the decode graph that served rows on `adapters`
    (the forward pass alone: no sampling, no host work)."""
    graphs = eng.runner.graphs
    if graphs is None:
        return float("nan")
    graph = decode_graph(eng, adapters)
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); graph.replay(); e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def time_decode(eng, timer: HostTimer, batch: int, adapters: list[str | None],
                prompt_len: int, steps: int, gen, clock: GcClock) -> dict:
    """Wall seconds per decode step with `batch` running sequences (back-to-back steps,
    one sync at each end: with async scheduling a step returns while the next one runs),
    the median host seconds per step in schedule/fill/update, the graph's GPU time, and
    the garbage collections inside the timed steps (seconds in all, the longest one, and
    how many were full ones)."""
    from loramux_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=steps + 10, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(10, 100000, (prompt_len,), generator=gen).tolist()
        eng.add_request(f"r{time.monotonic_ns()}-{i}", prompt, params, adapters[i])
    # prefill (possibly several steps), then four warm decode steps: the graph's capture
    # (with async scheduling a step's own work may start a step later than its call)
    while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
        eng.step()
    for _ in range(4):
        eng.step()
    torch.cuda.synchronize()
    host = []
    timer.take()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
        host.append(timer.take())
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    wall = (t1 - t0) / steps
    gcs = clock.between(t0, t1)
    gpu = graph_replay_s(eng, adapters)
    for r in list(eng.scheduler.running) + list(eng.scheduler.waiting):
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    med = {k: statistics.median(h[k] for h in host) for k in host[0]}
    return {"step": wall, "host": sum(med.values()), "gpu": gpu, **med,
            "gc": sum(c.seconds for c in gcs),
            "gc_max": max((c.seconds for c in gcs), default=0.0),
            "gc_full": sum(c.generation == 2 for c in gcs)}


def hf_baseline(model_dir: Path, adapter_dirs: list[Path], batches: list[int], prompt_len: int,
                new_tokens: int, gen) -> list[dict]:
    """HF transformers + PEFT: generate with adapter_names, one distinct adapter per row.
    Decode time per token = (t(1 + k tokens) - t(1 token)) / k."""
    from peft import PeftModel
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k not in ("architectures", "model_type", "torch_dtype")})
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    model.eval()
    n_adapters = max(batches)
    peft = PeftModel.from_pretrained(model, str(adapter_dirs[0]), adapter_name="a0")
    for i in range(1, n_adapters):
        peft.load_adapter(str(adapter_dirs[i % len(adapter_dirs)]), adapter_name=f"a{i}")
    rows = []
    for b in batches:
        ids = torch.randint(10, 100000, (b, prompt_len), generator=gen).cuda()
        mask = torch.ones_like(ids)
        names = [f"a{i}" for i in range(b)]

        def run(k):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            with torch.no_grad():
                peft.generate(input_ids=ids, attention_mask=mask, adapter_names=names,
                              max_new_tokens=k, min_new_tokens=k, do_sample=False)
            torch.cuda.synchronize()
            return time.perf_counter() - t0
        run(2)
        t1, tk = run(1), run(1 + new_tokens)
        step = (tk - t1) / new_tokens
        rows.append({"system": "hf-peft", "mode": "distinct", "batch": b, "step_ms": step * 1e3,
                     "tokens_per_s": b / step})
        print(f"hf-peft distinct b={b}: {step*1e3:.1f} ms/step {b/step:.1f} tok/s", flush=True)
    del peft, model
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batches", default="1,8,16,32,64,128,256")
    ap.add_argument("--modes", default="base,one,distinct,d64",
                    help="base; one adapter for all rows; distinct: one adapter per row; "
                         "d64: 64 adapters round robin (4 rows each at batch 256); "
                         "dora / head: one rank-16 DoRA adapter / one with LoRA on "
                         "lm_head too, for all rows")
    ap.add_argument("--profile-batches", default="64",
                    help="batches whose decode graphs are profiled (empty: none)")
    ap.add_argument("--profile-modes", default="base,one,distinct",
                    help="modes profiled at those batches (distinct: 64 adapters round robin)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--hf-batches", default="8,16,32,64")
    ap.add_argument("--hf-tokens", type=int, default=2)
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--eager", action="store_true", help="disable CUDA graphs")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--async-scheduling", choices=("auto", "on", "off"), default="auto",
                    help="auto: the engine's default (on for one CUDA device)")
    ap.add_argument("--mixed-paths", default="rule",
                    help="comma list of mixed decode LoRA paths (rule: the engine's; table: "
                         "the table alone, before the rows-per-adapter rule; tokens; "
                         "segments): the modes distinct and d64 run once per path")
    ap.add_argument("--lora-gemm", default="default",
                    help="comma list of engine/lora/batch.py FUSED_LORA_GEMM settings (off, "
                         "rows, cols, all; default: the engine's): every mode runs once per "
                         "setting, in this order, on one engine (built with the spare weight "
                         "rows and columns unless the engine's setting is off)")
    args = ap.parse_args()
    paths = args.mixed_paths.split(",")
    if not set(paths) <= set(MIXED_PATHS):
        ap.error(f"--mixed-paths: {paths} not all in {tuple(MIXED_PATHS)}")
    gemms = args.lora_gemm.split(",")
    from loramux_engine.lora.batch import LORA_GEMM_MODES
    if not set(gemms) <= set(LORA_GEMM_MODES + ("default",)):
        ap.error(f"--lora-gemm: {gemms} not all in {LORA_GEMM_MODES + ('default',)}")
    if args.quick:
        args.batches, args.steps, args.hf_batches = "1,64", 8, "8"
    args.out.mkdir(parents=True, exist_ok=True)
    batches = [int(b) for b in args.batches.split(",")]
    gen = torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy bandwidth {bw/1e12:.2f} TB/s", flush=True)

    work = Path(tempfile.mkdtemp(prefix="loramux-bench-"))
    model_dir = write_model_dir(work / "model")
    adapter_dirs = [write_adapter(work / f"adapter{i}", model_dir, RANK, seed=i)
                    for i in range(NUM_ADAPTER_FILES)]
    rows = []
    if not args.no_hf:
        rows += hf_baseline(model_dir, adapter_dirs, [int(b) for b in args.hf_batches.split(",")],
                            args.prompt_len, args.hf_tokens, gen)
    max_b = max(batches)
    eng = make_engine(model_dir, max_loras=max_b, max_batch=max_b, enforce_eager=args.eager,
                      prompt_len=args.prompt_len, steps=args.steps,
                      async_scheduling={"auto": None, "on": True, "off": False}[
                          args.async_scheduling])
    print(f"async scheduling: {eng.config.use_async_scheduling}", flush=True)
    fused = eng.runner.fused
    print(f"spare weight rows and columns for one adapter: {fused.nbytes / 2**20:.1f} MiB; "
          f"{strided_weight_copies(eng.runner.model)}" if fused else "no spare weight rows",
          flush=True)
    timer = HostTimer(eng)
    names = []
    for i in range(max_b):
        names.append(f"bench{i}")
        eng.add_adapter(names[-1], str(adapter_dirs[i % len(adapter_dirs)]))
    for extra in {"dora", "head"} & set(args.modes.split(",") + args.profile_modes.split(",")):
        eng.add_adapter(extra, str(write_adapter(work / extra, model_dir, RANK, seed=9,
                                                 **{extra: True})))
    from loramux_core.gc_heap import freeze_heap
    print(f"gc: {freeze_heap()} objects frozen", flush=True)
    clock = GcClock()
    cfg = LLAMA3_8B
    points = [(lg, m, p) for lg in gemms for m in args.modes.split(",")
              for p in (paths if m in MIXED_MODES else ["rule"])]
    for gemm, mode, path in points:
        select_mixed_path(eng, path)
        select_lora_gemm(eng, gemm)
        label = gemm_label(mixed_label(mode, path), gemm, gemms)
        for b in batches:
            adapters = mode_adapters(mode, b, names)
            t = time_decode(eng, timer, b, adapters, args.prompt_len, args.steps, gen, clock)
            step = t["step"]
            n_ad = {"base": 0, "distinct": b, "d64": min(b, 64)}.get(mode, 1)
            ctx = b * (args.prompt_len + 3 + args.steps // 2)
            floor_b = weight_bytes(cfg, b) + kv_bytes(cfg, ctx) + n_ad * adapter_bytes(cfg, RANK)
            floor = floor_b / bw
            rows.append({"system": "loramux", "mode": label, "batch": b, "step_ms": step * 1e3,
                         "tokens_per_s": b / step, "floor_ms": floor * 1e3,
                         "x_floor": step / floor, "gpu_ms": t["gpu"] * 1e3,
                         "gpu_x_floor": t["gpu"] / floor, "host_ms": t["host"] * 1e3,
                         "schedule_ms": t["schedule"] * 1e3, "fill_ms": t["fill"] * 1e3,
                         "update_ms": t["update"] * 1e3, "gc_ms": t["gc"] * 1e3,
                         "gc_max_ms": t["gc_max"] * 1e3, "gc_full": t["gc_full"]})
            print(f"loramux {label:8s} b={b:4d}: {step*1e3:7.2f} ms/step {b/step:9.1f} tok/s "
                  f"floor {floor*1e3:6.2f} ms x{step/floor:.2f} | graph {t['gpu']*1e3:6.2f} ms "
                  f"x{t['gpu']/floor:.2f} | host {t['host']*1e3:5.2f} ms | gc "
                  f"{t['gc']*1e3:6.2f} ms, longest {t['gc_max']*1e3:6.2f}, {t['gc_full']} full",
                  flush=True)
    select_mixed_path(eng, "rule")
    launches = []
    profile_batches = [int(b) for b in args.profile_batches.split(",") if b]
    for gemm in (gemms if not args.eager else []):
        select_lora_gemm(eng, gemm)
        name = gemm_label("profile", gemm, gemms).replace("/", "-") + ".txt"
        launches += profile_graphs(
            eng, names, args, gen, args.out / name, profile_batches,
            args.profile_modes.split(","), lambda m, lg=gemm: gemm_label(m, lg, gemms))
    meta = {"device": torch.cuda.get_device_name(), "copy_bw_Bps": bw, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d"), "argv": sys.argv,
            "async_scheduling": eng.config.use_async_scheduling, "mixed_paths": paths,
            "lora_gemm": gemms}
    (args.out / "decode.json").write_text(json.dumps({"meta": meta, "rows": rows,
                                                      "launches": launches}, indent=2))
    plot(rows, args.out / "decode_throughput.png")
    print("\n| system | mode | batch | step ms | tokens/s | x floor | graph ms | graph x floor "
          "| host ms |\n|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for r in rows:
        print(f"| {r['system']} | {r['mode']} | {r['batch']} | {r['step_ms']:.2f} | "
              f"{r['tokens_per_s']:.1f} | {r.get('x_floor', nan):.2f} | {r.get('gpu_ms', nan):.2f} "
              f"| {r.get('gpu_x_floor', nan):.2f} | {r.get('host_ms', nan):.2f} |")
    if launches:
        print("\n| mode | batch | launches per replay | LoRA launches | GPU ms per replay |"
              "\n|---|---|---|---|---|")
        for r in launches:
            print(f"| {r['mode']} | {r['batch']} | {r['launches']:.0f} | {r['lora_launches']:.0f} "
                  f"| {r['gpu_ms']:.2f} |")


def profile_graphs(eng, names: list[str], args, gen, path: Path, batches: list[int],
                   modes: list[str], label=lambda mode: mode) -> list[dict]:
    """Kernel time by name over 5 replays of each batch's decode graph in each mode
    ("distinct": 64 adapters round robin, one per row up to batch 64; profile evidence for
    BENCHMARKS.md), and the launches per replay (device events / replays), all and LoRA's
    (the fused norm + shrink counts as LoRA's); rows named label(mode)."""
    from torch.profiler import ProfilerActivity, profile
    lines, counts, replays = [], [], 5
    for b, mode in [(b, m) for m in modes for b in batches if b <= len(names)]:
        adapters = (mode_adapters("d64", b, names) if mode == "distinct"
                    else mode_adapters(mode, b, names))
        from loramux_engine import SamplingParams
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        for i in range(b):
            prompt = torch.randint(10, 100000, (args.prompt_len,), generator=gen).tolist()
            eng.add_request(f"p{b}{mode}{i}", prompt, params, adapters[i])
        while eng.scheduler.waiting or any(r.num_output_tokens == 0 for r in eng.scheduler.running):
            eng.step()
        eng.step()
        graph = decode_graph(eng, adapters)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(replays):
                graph.replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=20)
        events = device_events(prof)
        counts.append({"mode": label(mode), "batch": b, "launches": len(events) / replays,
                       "lora_launches": sum("lora" in e.name or "shrink" in e.name
                                            for e in events) / replays,
                       "gpu_ms": sum(e.device_time_total for e in events) / replays / 1e3})
        lines += [f"== batch {b} {label(mode)}: {replays} graph replays, "
                  f"{counts[-1]['launches']:.0f} launches per replay "
                  f"({counts[-1]['lora_launches']:.0f} LoRA) ==", table]
        for r in list(eng.scheduler.running) + list(eng.scheduler.waiting):
            eng.abort(r.request_id)
        while eng.has_unfinished():
            eng.step()
    path.write_text("\n".join(lines))
    print("\n".join(lines)[:6000], flush=True)
    return counts


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for system, mode in sorted({(r["system"], r["mode"]) for r in rows}):
        pts = sorted((r["batch"], r["tokens_per_s"]) for r in rows
                     if r["system"] == system and r["mode"] == mode)
        ax.plot(*zip(*pts), marker="o", label=f"{system} {mode}")
    ax.set_xscale("log", base=2); ax.set_yscale("log")
    ax.set_xlabel("batch size"); ax.set_ylabel("decode tokens/s")
    ax.set_title("Llama-3-8B shape, bf16, rank-16 adapters")
    ax.grid(True, which="both", alpha=0.3); ax.legend()
    fig.tight_layout(); fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
