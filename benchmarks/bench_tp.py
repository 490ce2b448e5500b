"""Tensor parallelism on several GPUs (NCCL).

    python benchmarks/bench_tp.py parity --tp 2 --out DIR
    python benchmarks/bench_tp.py decode --tp 1 --out DIR [--eager]
    python benchmarks/bench_tp.py decode --tp 2 --out DIR [--eager]

`parity`: a tiny random Llama (GQA) with three adapters of different ranks, bf16 on CUDA:
TP=N against TP=1 for a mixed batch (adapters and base). In bf16 the two split their
matmuls and all-reduces differently, so greedy tokens may part after a near-tie; we report
the first-token logprob difference (tolerance 0.05) and the share of tokens equal up to the
first divergence.

`decode`: the Llama-3-8B-shaped model with random bf16 weights, prompt 128, batches 1 and
64, with 0 adapters, one rank-16 adapter for all, and one distinct adapter per request
(registered from a few files under distinct names, as in bench_decode.py). One process per
call: a process holds one NCCL default group.
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
from benchmarks.llama8b import write_adapter, write_model_dir  # noqa: E402

RANK = 16
LOGPROB_TOL = 0.05


def parity(args) -> dict:
    from engine import Engine, EngineConfig, SamplingParams
    from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

    work = Path(tempfile.mkdtemp(prefix="loramux-tp-"))
    model = make_model(work / "model", TinySpec(hidden_size=128, num_heads=4, num_kv_heads=2,
                                                intermediate_size=256))
    specs = {"r4": AdapterSpec(r=4, seed=1), "r8rs": AdapterSpec(r=8, use_rslora=True, seed=2),
             "r32": AdapterSpec(r=32, lora_alpha=32, seed=3)}
    adapters = {n: make_adapter(work / n, model, s) for n, s in specs.items()}
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 60, (12,), generator=gen)]
    names = [None, "r4", "r8rs", "r32"] * 3
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=True)
    outs = {}
    for tp in (1, args.tp):
        eng = Engine(EngineConfig(model=str(model), device=args.device, dtype=args.dtype, tp_size=tp,
                                  max_loras=4, max_lora_rank=32, num_kv_blocks=256,
                                  max_num_batched_tokens=64))
        for n, p in adapters.items():
            eng.add_adapter(n, p)
        outs[tp] = eng.generate(prompts, params, names)
        eng.close()
    same, total, first_lp = 0, 0, []
    for a, b in zip(outs[1], outs[args.tp]):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 len(a.token_ids))
        same, total = same + n, total + len(a.token_ids)
        first_lp.append(abs(a.logprobs[0] - b.logprobs[0]))
    res = {"tp": args.tp, "device": args.device, "dtype": args.dtype, "requests": len(prompts),
           "first_token_equal": sum(a.token_ids[0] == b.token_ids[0]
                                    for a, b in zip(outs[1], outs[args.tp])),
           "tokens_equal_before_divergence": same, "tokens": total,
           "max_first_logprob_diff": max(first_lp), "tolerance": LOGPROB_TOL}
    res["ok"] = res["max_first_logprob_diff"] <= LOGPROB_TOL
    return res


def decode(args) -> list[dict]:
    from engine import Engine, EngineConfig, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="loramux-tp-"))
    model_dir = write_model_dir(work / "model")
    files = [write_adapter(work / f"a{i}", model_dir, RANK, seed=i) for i in range(4)]
    max_b = max(args.batches)
    eng = Engine(EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", tp_size=args.tp,
        max_loras=max_b, max_lora_rank=RANK, load_format="dummy", max_num_seqs=max_b,
        max_num_batched_tokens=8192, num_kv_blocks=max_b * 12 + 64, max_model_len=1024,
        enable_prefix_caching=False, enforce_eager=args.eager))
    names = [f"bench{i}" for i in range(max_b)]
    for i, n in enumerate(names):
        eng.add_adapter(n, str(files[i % len(files)]))
    gen = torch.Generator().manual_seed(0)
    rows = []
    for mode in ("base", "one", "distinct"):
        for b in args.batches:
            adapters = {"base": [None] * b, "one": [names[0]] * b, "distinct": names[:b]}[mode]
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 8, ignore_eos=True)
            ids = [f"{mode}-{b}-{i}" for i in range(b)]
            for rid, ad in zip(ids, adapters):
                eng.add_request(rid, torch.randint(10, 100000, (128,), generator=gen).tolist(),
                                params, ad)
            for _ in range(4):  # prefill + warm decode steps (graph capture)
                eng.step()
            times = []
            for _ in range(args.steps):
                torch.cuda.synchronize(); t0 = time.perf_counter()
                eng.step()
                torch.cuda.synchronize(); times.append(time.perf_counter() - t0)
            for rid in ids:
                eng.abort(rid)
            while eng.has_unfinished():
                eng.step()
            step = statistics.median(times)
            rows.append({"tp": args.tp, "eager": args.eager, "mode": mode, "batch": b,
                         "step_ms": step * 1e3, "tokens_per_s": b / step})
            print(f"tp={args.tp} eager={args.eager} {mode:8s} b={b:3d}: {step*1e3:7.2f} ms "
                  f"{b/step:9.1f} tok/s", flush=True)
    eng.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("parity", "decode"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--device", default="cuda", help="parity only: cpu runs it on gloo")
    ap.add_argument("--dtype", default="bfloat16", help="parity only")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = parity(args) if args.phase == "parity" else decode(args)
    tag = f"{args.phase}_tp{args.tp}{'_eager' if args.eager else ''}"
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
