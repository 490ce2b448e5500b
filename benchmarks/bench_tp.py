"""Tensor parallelism on several GPUs (NCCL, and the one-shot symmetric-memory all-reduce).

    python benchmarks/bench_tp.py allreduce --out DIR
    python benchmarks/bench_tp.py parity --tp 2 --out DIR [--eager]
    python benchmarks/bench_tp.py decode --tp 1 --out DIR [--eager]
    python benchmarks/bench_tp.py decode --tp 2 --allreduce {auto,nccl,symm_mem} --out DIR [--profile]

`allreduce`: benchmarks/tp_allreduce.py (one-shot vs NCCL sums, eager and in CUDA graphs,
then microseconds per all-reduce); exit code 1 unless every check passed on both ranks.

`parity`: a tiny random Llama (GQA) with three adapters of different ranks, bf16 on CUDA:
TP=N against TP=1 for a mixed batch (adapters and base). In bf16 the two split their
matmuls and all-reduces differently, so greedy tokens may part after a near-tie; we report
the first-token logprob difference (tolerance 0.05) and the share of tokens equal up to the
first divergence. Progress lines carry the seconds since start (Triton compiles on a
cold cache, and CUDA graphs are captured per bucket).

`decode`: the Llama-3-8B-shaped model with random bf16 weights, prompt 128, batches 1 and
64, with 0 adapters, one rank-16 adapter for all, and one distinct adapter per request
(registered from a few files under distinct names, as in bench_decode.py). For batch 64,
rank 0's step breakdown (benchmarks/tp_probe.py): host time from step start to the graph
replay, GPU time of the replay, the rest; `--profile` adds a torch.profiler table of 5
base decode steps at batch 64. One process per call: a process holds one NCCL group.
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
T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


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
    progress("model and adapters written")
    for tp in (1, args.tp):
        eng = Engine(EngineConfig(model=str(model), device=args.device, dtype=args.dtype,
                                  tp_size=tp, max_loras=4, max_lora_rank=32, num_kv_blocks=256,
                                  max_num_batched_tokens=64, max_num_seqs=16,
                                  enforce_eager=args.eager, tp_allreduce=args.allreduce))
        progress(f"tp={tp}: engine up (allreduce: {_allreduce_in_use(eng)})")
        for n, p in adapters.items():
            eng.add_adapter(n, p)
        eng.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=3), names[:2])
        progress(f"tp={tp}: warm-up done (kernels compiled)")
        outs[tp] = eng.generate(prompts, params, names)
        progress(f"tp={tp}: {len(prompts)} requests generated")
        if tp == 1:
            eng.close()
    res = _compare(outs, args, len(prompts))
    t0 = time.perf_counter()
    eng.close()   # after the result is out: a teardown that hangs loses nothing
    progress(f"tp={args.tp}: engine closed in {time.perf_counter() - t0:.1f} s")
    return res


def _compare(outs: dict, args, num_requests: int) -> dict:
    same, total, first_lp = 0, 0, []
    for a, b in zip(outs[1], outs[args.tp]):
        n = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                 len(a.token_ids))
        same, total = same + n, total + len(a.token_ids)
        first_lp.append(abs(a.logprobs[0] - b.logprobs[0]))
    res = {"tp": args.tp, "device": args.device, "dtype": args.dtype, "eager": args.eager,
           "allreduce": args.allreduce, "requests": num_requests,
           "first_token_equal": sum(a.token_ids[0] == b.token_ids[0]
                                    for a, b in zip(outs[1], outs[args.tp])),
           "tokens_equal_before_divergence": same, "tokens": total,
           "max_first_logprob_diff": max(first_lp), "tolerance": LOGPROB_TOL}
    res["ok"] = res["max_first_logprob_diff"] <= LOGPROB_TOL
    print(f"parity: tp={args.tp} ok={res['ok']} max_first_logprob_diff="
          f"{res['max_first_logprob_diff']:.4f} tokens_equal={same}/{total}", flush=True)
    return res


def _allreduce_in_use(eng) -> str:
    tp = eng.executor.tp
    if tp.size == 1:
        return "none (one rank)"
    return "one-shot (symm_mem)" if tp.reducer is not None else "process group (NCCL/gloo)"


def decode(args) -> list[dict]:
    from benchmarks.tp_probe import StepProbe, profile_steps
    from engine import Engine, EngineConfig, SamplingParams

    work = Path(tempfile.mkdtemp(prefix="loramux-tp-"))
    model_dir = write_model_dir(work / "model")
    files = [write_adapter(work / f"a{i}", model_dir, RANK, seed=i) for i in range(4)]
    progress("model config and adapter files written")
    max_b = max(args.batches)
    eng = Engine(EngineConfig(
        model=str(model_dir), device="cuda", dtype="bfloat16", tp_size=args.tp,
        max_loras=max_b, max_lora_rank=RANK, load_format="dummy", max_num_seqs=max_b,
        max_num_batched_tokens=8192, num_kv_blocks=max_b * 12 + 64, max_model_len=1024,
        enable_prefix_caching=False, enforce_eager=args.eager, tp_allreduce=args.allreduce))
    used = _allreduce_in_use(eng)
    progress(f"engine up: tp={args.tp} allreduce requested={args.allreduce} in use={used}")
    names = [f"bench{i}" for i in range(max_b)]
    for i, n in enumerate(names):
        eng.add_adapter(n, str(files[i % len(files)]))
    probe = StepProbe(eng.runner)
    gen = torch.Generator().manual_seed(0)
    rows = []
    tag = f"tp={args.tp} ar={args.allreduce} eager={args.eager}"
    for mode in args.modes:
        for b in args.batches:
            adapters = {"base": [None] * b, "one": [names[0]] * b, "distinct": names[:b]}[mode]
            params = SamplingParams(temperature=0.0, max_tokens=args.steps + 16, ignore_eos=True)
            ids = [f"{mode}-{b}-{i}" for i in range(b)]
            for rid, ad in zip(ids, adapters):
                eng.add_request(rid, torch.randint(10, 100000, (128,), generator=gen).tolist(),
                                params, ad)
            for _ in range(4):  # prefill + warm decode steps (graph capture)
                eng.step()
            probe.reset()
            times = []
            for _ in range(args.steps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                probe.start(t0)
                eng.step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            step = statistics.median(times)
            row = {"tp": args.tp, "allreduce": args.allreduce, "in_use": used,
                   "eager": args.eager, "mode": mode, "batch": b, "step_ms": step * 1e3,
                   "tokens_per_s": b / step, **probe.summary(times)}
            rows.append(row)
            print(f"{tag} {mode:8s} b={b:3d}: {step*1e3:7.2f} ms {b/step:9.1f} tok/s",
                  flush=True)
            if b == 64 and row.get("replay_gpu_ms") is not None:
                print(f"breakdown {tag} {mode:8s} b={b:3d}: step {step*1e3:6.2f} ms | host "
                      f"to replay {row['host_to_replay_ms']:5.2f} ms | replay GPU "
                      f"{row['replay_gpu_ms']:5.2f} ms | rest {row['rest_ms']:5.2f} ms",
                      flush=True)
            if args.profile and mode == "base" and b == max_b:
                try:
                    profile_steps(eng, 5)
                except Exception as exc:  # noqa: BLE001 - the timings above still count
                    print(f"profile failed: {type(exc).__name__}: {exc}", flush=True)
            for rid in ids:
                eng.abort(rid)
            while eng.has_unfinished():
                eng.step()
    eng.close()
    progress("done")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("allreduce", "parity", "decode"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--allreduce", default="auto", choices=("auto", "nccl", "symm_mem"))
    ap.add_argument("--profile", action="store_true", help="decode: profile 5 steps at b=64")
    ap.add_argument("--device", default="cuda", help="parity only: cpu runs it on gloo")
    ap.add_argument("--dtype", default="bfloat16", help="parity only")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="allreduce: seconds before the two ranks are killed (keep it under "
                         "any outer timeout, so that no rank outlives this process)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 64])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["base", "one", "distinct"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "allreduce":
        from benchmarks.tp_allreduce import run
        result = run(args.out, size=args.tp, timeout_s=args.timeout)
    else:
        result = parity(args) if args.phase == "parity" else decode(args)
    tag = f"{args.phase}_tp{args.tp}{'_eager' if args.eager else ''}_{args.allreduce}"
    (args.out / f"{tag}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1), flush=True)
    if args.phase in ("allreduce", "parity") and not result.get("ok"):
        sys.exit(1)


if __name__ == "__main__":
    main()
