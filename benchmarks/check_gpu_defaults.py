"""The engine's automatic defaults on this GPU, under the heaviest load they allow.

    python -m benchmarks.serving defaults --out DIR [--rank 16] [--adapters 64]

Builds the engine exactly as `loramux serve` would with no flags (device, dtype, slots,
host copies, sequence and token budgets, KV cache all resolved by engine/resolve.py) on
a Llama-3-8B-shaped model with random weights (nothing downloaded), prints what it
chose and where the GPU memory went, then runs max_num_seqs requests of 512-token
prompts over --adapters distinct rank --rank adapters (every step at the token budget,
every CUDA graph batch size reached) and reports the peak memory against the
gpu_memory_utilization budget. An out-of-memory error here means the activation
reserve (engine/resolve.py runtime_reserve_bytes) is too small for this GPU.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks import llama8b  # noqa: E402
from benchmarks.common import report  # noqa: E402

GiB = 1 << 30


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=16, help="max_lora_rank and adapter rank")
    ap.add_argument("--adapters", type=int, default=64, help="distinct adapter names")
    ap.add_argument("--distinct-files", type=int, default=4,
                    help="adapter directories written (names share them round robin)")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: this check needs a CUDA GPU", file=sys.stderr)
        return 2

    from loramux_engine import Engine, EngineConfig, SamplingParams

    root = Path(tempfile.mkdtemp(prefix="check-gpu-defaults-"))
    model = llama8b.write_model_dir(root / "model")
    dirs = [llama8b.write_adapter(root / f"a{i}", model, rank=args.rank, seed=i)
            for i in range(args.distinct_files)]
    t0 = time.perf_counter()
    eng = Engine(EngineConfig(model=str(model), load_format="dummy",
                              max_lora_rank=args.rank))
    build_s = time.perf_counter() - t0
    free, total = torch.cuda.mem_get_info()
    budget = eng.config.gpu_memory_utilization * total
    print(f"resolved: {eng.describe()}")
    print(f"built in {build_s:.1f} s; in use after build {(total - free) / GiB:.1f} GiB of "
          f"{total / GiB:.1f} GiB (budget {budget / GiB:.1f} GiB); LoRA pool "
          f"{eng.lora_pool.nbytes / GiB:.1f} GiB")
    names = [f"ad{i}" for i in range(min(args.adapters, eng.config.max_cpu_loras))]
    for i, name in enumerate(names):
        eng.add_adapter(name, dirs[i % len(dirs)])
    n = eng.config.max_num_seqs
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 120000, (args.prompt,), generator=g).tolist() for _ in range(n)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    outs = eng.generate(prompts, params, adapters=[names[i % len(names)] for i in range(n)])
    run_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    free_after, _ = torch.cuda.mem_get_info()
    tokens = sum(len(o.token_ids) for o in outs)
    result = {"config": eng.describe(), "build_s": build_s, "total_gib": total / GiB,
              "budget_gib": budget / GiB, "in_use_after_build_gib": (total - free) / GiB,
              "in_use_after_run_gib": (total - free_after) / GiB,
              "peak_allocated_gib": torch.cuda.max_memory_allocated() / GiB,
              "requests": n, "adapters": len(names), "output_tokens": tokens,
              "run_s": run_s, "output_tok_s": tokens / run_s}
    eng.close()
    c = eng.config
    report(args.out, "gpu_defaults.json", result, {
        "max_loras": str(c.max_loras), "max_cpu_loras": str(c.max_cpu_loras),
        "max_num_seqs": str(c.max_num_seqs), "batched tokens": str(c.max_num_batched_tokens),
        "KV blocks": str(eng.num_kv_blocks),
        "in use after build / run (GiB)": f"{result['in_use_after_build_gib']:.1f} / "
                                          f"{result['in_use_after_run_gib']:.1f}",
        "budget (GiB)": f"{result['budget_gib']:.1f}",
        "requests x adapters": f"{n} x {len(names)}", "tok/s": f"{result['output_tok_s']:.0f}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
