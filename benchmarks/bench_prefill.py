"""End-to-end prefill throughput of the engine on the Llama-3-8B shape (random bf16 weights,
nothing downloaded): the base model, one rank-16 adapter for every prompt, and 64 adapters
round robin, with chunked prefill at the engine's default token budget.

    python -m benchmarks.decode prefill --out DIR [--prompts 64] [--min-len 512]
        [--max-len 2048] [--modes base,one,l64] [--paths tiles]

Every prompt asks for one new token, so a request finishes with its last prefill chunk and
the time measured is prefill (plus one sampled token per prompt). Each (mode, path) runs an
untimed round first (kernel compiles, adapter loads), then a timed round of fresh prompts
of the same lengths (prefix caching off). Paths (adapter modes only): "tiles" runs the LoRA
prefill kernels of kernels/lora/segment.py (the one prefill path). The bf16 matmul rate
is measured in the same run; "% matmul" is the model's FLOPs (projections and causal
attention) per second over it. "adapters/step" is what FCFS packing of the prompts into
the token budget gives (the scheduler's order), i.e. the distinct adapters a step's LoRA
kernels see. Writes DIR/prefill.json; prints a short table. --device cpu --tiny runs the
same flow on a 2-layer toy model (tests).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.llama8b import (LLAMA3_8B, module_shapes, write_adapter,  # noqa: E402
                                write_model_dir)

RANK = 16
NUM_ADAPTERS = 64
NUM_ADAPTER_FILES = 4
TINY = dict(LLAMA3_8B, vocab_size=512, hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            bos_token_id=1, eos_token_id=2)


def prompt_lengths(n: int, lo: int, hi: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(lo, hi) for _ in range(n)]


def flops(cfg: dict, lengths: list[int]) -> float:
    """Projection FLOPs (2 per weight per token) plus causal attention (QK and PV: 2 x n^2/2
    x 2 FLOPs per query width per layer) of prefilling `lengths`."""
    linear = sum(fi * fo for fi, fo in module_shapes(cfg).values())
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    per_layer = sum(2 * linear * n + 2 * n * n * q for n in lengths)
    return float(cfg["num_hidden_layers"] * per_layer)


def adapters_per_step(lengths: list[int], adapters: list, budget: int) -> float:
    """Mean distinct adapters per step when the prompts fill steps of `budget` tokens in
    order (chunked prefill, first come first served)."""
    steps, current, room = [], set(), budget
    for n, adapter in zip(lengths, adapters):
        while n > 0:
            current.add(adapter)
            take = min(n, room)
            n, room = n - take, room - take
            if room == 0:
                steps.append(current)
                current, room = set(), budget
    if current:
        steps.append(current)
    return statistics.mean(len(s - {None}) for s in steps)


def matmul_flops(device: str, n: int = 8192, reps: int = 5) -> float:
    """bf16 n^3 matmul FLOP/s on random data (CUDA events); nan off CUDA."""
    if device != "cuda":
        return float("nan")
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    a @ b
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); a @ b; e.record(); e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / statistics.median(times)


def make_engine(model_dir: Path, device: str, prompts: int, max_len: int):
    from loramux_engine import Engine, EngineConfig

    per_seq = -(-(max_len + 16) // 16)
    cfg = EngineConfig(model=str(model_dir), device=device,
                       dtype="bfloat16" if device == "cuda" else "float32",
                       max_loras=NUM_ADAPTERS, max_lora_rank=RANK, load_format="dummy",
                       max_num_seqs=prompts, num_kv_blocks=prompts * per_seq + 64,
                       max_model_len=max_len + 16, enable_prefix_caching=False)
    eng = Engine(cfg)
    # Host copies by path: the adapter files are read once, each name still gets its own
    # id, slot and device copy (what a step reads). Benchmark-only shortcut.
    loader = eng.adapters.loader
    loader._load_weights = functools.lru_cache(maxsize=None)(loader._load_weights)
    return eng


@contextlib.contextmanager
def prefill_path(path: str):
    """The LoRA prefill kernels of `path` ("tiles"; "-": the default): one path, the
    tile list (kernels/lora/plan.py), so nothing changes."""
    if path not in ("-", "tiles"):
        raise ValueError(f"prefill path {path!r}: the tile list ('tiles') is the only one")
    yield


def run_round(eng, lengths: list[int], adapters: list, vocab: int, tag: str, seed: int) -> float:
    """Seconds from queueing every prompt to the last one finished."""
    from loramux_engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(10, vocab, (n,), generator=gen).tolist() for n in lengths]
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for i, (p, a) in enumerate(zip(prompts, adapters)):
        eng.add_request(f"{tag}-{i}", p, params, a)
    while eng.has_unfinished():
        eng.step()
    sync()
    return time.perf_counter() - t0


def bench(args) -> list[dict]:
    base_cfg = TINY if args.tiny else LLAMA3_8B
    work = Path(tempfile.mkdtemp(prefix="loramux-prefill-"))
    model_dir = write_model_dir(work / "model", base=base_cfg)
    files = [write_adapter(work / f"adapter{i}", model_dir, RANK, seed=i)
             for i in range(NUM_ADAPTER_FILES)]
    peak = matmul_flops(args.device)
    eng = make_engine(model_dir, args.device, args.prompts, args.max_len)
    names = [f"a{i}" for i in range(NUM_ADAPTERS)]
    for i, name in enumerate(names):
        eng.add_adapter(name, str(files[i % len(files)]))
    budget = eng.config.max_num_batched_tokens
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    print(f"device {name}: matmul {peak / 1e12:.0f} TFLOP/s, max_num_batched_tokens {budget}",
          flush=True)
    lengths = prompt_lengths(args.prompts, args.min_len, args.max_len, args.seed)
    work_flops = flops(base_cfg, lengths)
    rows = []
    for mode in args.modes.split(","):
        adapters = {"base": [None] * len(lengths), "one": [names[0]] * len(lengths),
                    "l64": [names[i % NUM_ADAPTERS] for i in range(len(lengths))]}[mode]
        for path in (["-"] if mode == "base" else args.paths.split(",")):
            with prefill_path(path):
                run_round(eng, lengths, adapters, base_cfg["vocab_size"], f"w{mode}{path}",
                          seed=1)
                secs = run_round(eng, lengths, adapters, base_cfg["vocab_size"],
                                 f"t{mode}{path}", seed=2)
            row = {"mode": mode, "path": path, "prompts": len(lengths), "tokens": sum(lengths),
                   "seconds": secs, "tokens_per_s": sum(lengths) / secs,
                   "pct_matmul": 100 * work_flops / secs / peak,
                   "adapters_per_step": adapters_per_step(lengths, adapters, budget)}
            rows.append(row)
            print(f"prefill {mode:5} {path:7} {row['tokens']} tokens in {secs:.3f} s: "
                  f"{row['tokens_per_s']:,.0f} tok/s", flush=True)
    base = next((r["tokens_per_s"] for r in rows if r["mode"] == "base"), float("nan"))
    for r in rows:
        r["x_base"] = base / r["tokens_per_s"]
    meta = {"device": args.device, "matmul_flops": peak, "budget": budget,
            "lengths": lengths, "argv": sys.argv, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    eng.close()
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| mode | path | prompts | tokens | s | tokens/s | base / this | % matmul "
             "| adapters/step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['path']} | {r['prompts']} | {r['tokens']} | "
                     f"{r['seconds']:.3f} | {r['tokens_per_s']:,.0f} | {r['x_base']:.3f} | "
                     f"{r['pct_matmul']:.1f} | {r['adapters_per_step']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--min-len", type=int, default=512)
    p.add_argument("--max-len", type=int, default=2048)
    p.add_argument("--modes", default="base,one,l64",
                   help="base; one: one adapter for every prompt; l64: 64 adapters round robin")
    p.add_argument("--paths", default="tiles",
                   help="LoRA prefill kernels to run the adapter modes with (before/after)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer toy model (tests)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_prefill needs a CUDA GPU (or --device cpu --tiny)", file=sys.stderr)
        return 2
    rows = bench(args)
    print("\n" + table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
