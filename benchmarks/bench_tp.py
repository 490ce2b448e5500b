"""Tensor parallelism on several GPUs (NCCL, and the one-shot symmetric-memory all-reduce).

    python -m benchmarks.parallel allreduce --out DIR
    python -m benchmarks.parallel parity --tp 2 --out DIR [--eager]
    python -m benchmarks.parallel decode --tp 1 --out DIR [--eager] [--batches 1,64,256]
    python -m benchmarks.parallel decode --tp 2 --allreduce {auto,nccl,symm_mem} --out DIR
        [--async-scheduling auto|on|off|on,off] [--profile [--profile-modes base,distinct]]

`allreduce`: benchmarks/tp_allreduce.py (one-shot vs NCCL sums, eager and in CUDA graphs,
then microseconds per all-reduce); exit code 1 unless every check passed on both ranks.

`parity`: a tiny random Llama (GQA) with three adapters of different ranks, bf16 on CUDA:
TP=N against TP=1 for a mixed batch (adapters and base). In bf16 the two split their
matmuls and all-reduces differently, so greedy tokens may part after a near-tie; we report
the first-token logprob difference (tolerance 0.05) and the share of tokens equal up to the
first divergence. Progress lines carry the seconds since start (Triton compiles on a
cold cache, and CUDA graphs are captured per bucket).

`decode`: the Llama-3-8B-shaped model with random bf16 weights, prompt 128, at each of
`--batches`, with 0 adapters ("base"), one rank-16 adapter for all ("one"), and min(batch,
64) distinct adapters round robin ("distinct": one per request up to batch 64; registered
from a few files under distinct names, as in bench_decode.py). Each point is timed as
`--repeats` runs of `--steps` back-to-back greedy decode steps (one sync at each end, so
that async scheduling overlaps as it does when serving), the median run, once per value
of `--async-scheduling` (auto = the engine's default for this tp_size; several values are
timed on one engine, switched between runs with nothing in flight). Beside it, rank 0's
step breakdown (benchmarks/tp_probe.py): host time from step start to the graph replay,
GPU time of the replay, the rest (meaningful for sync steps; with async scheduling the
host part overlaps the step before). `--profile` adds a torch.profiler table of 5 steps at
each of `--profile-batches` x `--profile-modes`, with the collectives launched per step
(all-reduces, all-gathers: the same counts with and without adapters show that the LoRA
path adds none). One process per call: a process holds one NCCL group. The JSON rows are
written after every point, so a run cut off by a time limit keeps what it measured.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.llama8b import write_adapter, write_model_dir  # noqa: E402

RANK = 16
MAX_ADAPTERS = 64   # decode "distinct": min(batch, 64) adapters, round robin
WARM_STEPS = 4   # decode: steps before timing (graph capture)
LOGPROB_TOL = 0.05
T0 = time.perf_counter()


def progress(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.1f} s] {msg}", flush=True)


def parity(args) -> dict:
    from loramux_engine import Engine, EngineConfig, SamplingParams
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


ASYNC = {"auto": None, "on": True, "off": False}


def decode(args) -> list[dict]:
    from benchmarks.tp_probe import StepProbe, profile_steps
    from loramux_engine import Engine, EngineConfig

    work = Path(tempfile.mkdtemp(prefix="loramux-tp-"))
    model_dir, files, dtype = _decode_files(work, args.device)
    progress("model config and adapter files written")
    max_b = max(args.batches)
    n_adapters = min(max_b, MAX_ADAPTERS)
    # decode steps of one batch: the warm and timed steps (and one in flight), or a profile
    new_tokens = WARM_STEPS + args.repeats * args.steps + 24
    eng = Engine(EngineConfig(
        model=str(model_dir), device=args.device, dtype=dtype, tp_size=args.tp,
        max_loras=n_adapters, max_lora_rank=RANK, max_num_seqs=max_b,
        load_format="dummy" if args.device == "cuda" else "auto",
        max_num_batched_tokens=8192, num_kv_blocks=max_b * (-(-(128 + new_tokens) // 16) + 1) + 64,
        max_model_len=1024, enable_prefix_caching=False, enforce_eager=args.eager,
        tp_allreduce=args.allreduce, async_scheduling=ASYNC[args.async_scheduling[0]]))
    used = _allreduce_in_use(eng)
    progress(f"engine up: tp={args.tp} allreduce requested={args.allreduce} in use={used} "
             f"async scheduling={eng.config.use_async_scheduling}")
    names = [f"bench{i}" for i in range(n_adapters)]
    for i, n in enumerate(names):
        eng.add_adapter(n, str(files[i % len(files)]))
    progress(f"{n_adapters} adapters registered")
    batch = _Batches(eng, names, new_tokens)
    probe = StepProbe(eng.runner)
    rows = []
    # in the order given (the batch that matters most first), every mode with the first
    # async setting, then with the next, then the profiles (with the first setting)
    for b in args.batches:
        for setting in args.async_scheduling:
            for mode in args.modes:
                with batch.running(b, mode):
                    rows.append(_time_point(eng, probe, args, mode, b, setting, used))
                _save(args, rows)
        if not (args.profile and b in args.profile_batches):
            continue
        for mode in [m for m in args.profile_modes if m in args.modes]:
            row = next(r for r in rows if (r["batch"], r["mode"]) == (b, mode))
            with batch.running(b, mode):
                _set_async(eng, args.async_scheduling[0])
                try:
                    row["profile"] = profile_steps(
                        eng, 5, f"tp={args.tp} ar={args.allreduce} {mode} b={b}")
                except Exception as exc:  # noqa: BLE001 - the timings above still count
                    print(f"profile failed: {type(exc).__name__}: {exc}", flush=True)
            _save(args, rows)
    progress("measured; closing the engine")
    eng.close()
    progress("done")
    return rows


class _Batches:
    """Puts `b` requests of a mode in the engine, prefilled, for the time of a `with`."""

    def __init__(self, eng, names: list[str], new_tokens: int):
        from loramux_engine import SamplingParams
        from loramux_core.model.hf_config import ModelConfig

        self.eng, self.names = eng, names
        self.vocab = ModelConfig.from_dir(eng.config.model).vocab_size
        self.params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        self.gen = torch.Generator().manual_seed(0)
        self.count = 0

    @contextlib.contextmanager
    def running(self, b: int, mode: str):
        eng, names = self.eng, self.names
        adapters = {"base": [None] * b, "one": [names[0]] * b,
                    "distinct": [names[i % len(names)] for i in range(b)]}[mode]
        self.count += 1
        ids = [f"{mode}-{b}-{self.count}-{i}" for i in range(b)]
        for rid, ad in zip(ids, adapters):
            prompt = torch.randint(10, min(self.vocab, 100000), (128,), generator=self.gen)
            eng.add_request(rid, prompt.tolist(), self.params, ad)
        while eng.scheduler.waiting or any(r.num_output_tokens == 0
                                           for r in eng.scheduler.running):
            eng.step()   # prefill
        try:
            yield
        finally:
            for rid in ids:
                eng.abort(rid)
            while eng.has_unfinished():
                eng.step()


def _set_async(eng, setting: str) -> bool:
    """Benchmark-only switch, with nothing in flight: one engine measures every setting;
    auto = the engine's default for its tp_size."""
    eng.flush()
    default = dataclasses.replace(eng.config, async_scheduling=None).use_async_scheduling
    eng._async = default if ASYNC[setting] is None else ASYNC[setting]
    return eng._async


def _decode_files(work: Path, device: str) -> tuple[Path, list[Path], str]:
    """(model dir, adapter files, dtype): the Llama-3-8B shape with dummy bf16 weights on
    CUDA; on the CPU (a check of this script on gloo) the tiny test model in float32."""
    if device == "cuda":
        model_dir = write_model_dir(work / "model")
        return model_dir, [write_adapter(work / f"a{i}", model_dir, RANK, seed=i)
                           for i in range(4)], "bfloat16"
    from tests.support.tiny import AdapterSpec, make_adapter, make_model
    model_dir = make_model(work / "model")
    return model_dir, [make_adapter(work / f"a{i}", model_dir, AdapterSpec(r=8, seed=i + 1))
                       for i in range(2)], "float32"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time_point(eng, probe, args, mode: str, b: int, setting: str, used: str) -> dict:
    """Steps per second at batch `b` with async scheduling `setting`: WARM_STEPS steps
    (graph capture), then `repeats` runs of `steps` back-to-back steps (one sync at each
    end: with async scheduling a step returns while the next one runs); the median run."""
    async_on = _set_async(eng, setting)
    for _ in range(WARM_STEPS):
        eng.step()
    eng.flush()
    per_step = []
    probe.reset()
    for _ in range(args.repeats):
        sync()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            probe.start(time.perf_counter())
            eng.step()
        eng.flush()
        sync()
        per_step.append((time.perf_counter() - t0) / args.steps)
    step = statistics.median(per_step)
    row = {"tp": args.tp, "allreduce": args.allreduce, "in_use": used, "eager": args.eager,
           "async": async_on, "mode": mode, "batch": b, "step_ms": step * 1e3,
           "tokens_per_s": b / step, "runs_ms": [round(t * 1e3, 3) for t in per_step],
           **probe.summary(per_step)}
    tag = f"tp={args.tp} ar={args.allreduce} async={'on ' if async_on else 'off'}"
    print(f"{tag} {mode:8s} b={b:3d}: {step*1e3:7.2f} ms {b/step:9.1f} tok/s", flush=True)
    if row.get("replay_gpu_ms") is not None and b > 1:
        print(f"breakdown {tag} {mode:8s} b={b:3d}: step {step*1e3:6.2f} ms | host "
              f"to replay {row['host_to_replay_ms']:5.2f} ms | replay GPU "
              f"{row['replay_gpu_ms']:5.2f} ms | rest {row['rest_ms']:5.2f} ms", flush=True)
    return row


def _save(args, rows: list[dict]) -> None:
    """The rows so far (a run cut off by its time limit keeps what it measured)."""
    (args.out / f"{_tag(args)}.json").write_text(json.dumps(rows, indent=1))


def _tag(args) -> str:
    return f"{args.phase}_tp{args.tp}{'_eager' if args.eager else ''}_{args.allreduce}"


def table(args) -> dict:
    """The round's table from every decode_*.json under --out (and allreduce.json): tok/s
    per (batch, mode) for TP=1 and each TP=N all-reduce x async setting, the best TP=N
    over TP=1 for each N, then the profiles' collectives and kernel time by kind; and the
    curve of the best tok/s over the TP sizes (tp_curve.png beside --results, or under
    --out)."""
    rows, allreduce = [], None
    for path in sorted(args.out.rglob("*.json")):
        data = json.loads(path.read_text())
        if path.name.startswith("decode_") and isinstance(data, list):
            rows += data
        elif path.name == "allreduce.json":
            allreduce = data
    cols = sorted({(r["tp"], _col(r)) for r in rows if r["tp"] > 1})
    sizes = sorted({tp for tp, _ in cols})
    points = sorted({(r["batch"], r["mode"]) for r in rows},
                    key=lambda p: (p[0], ("base", "one", "distinct").index(p[1])
                                   if p[1] in ("base", "one", "distinct") else 9))
    best: dict[tuple[int, str, tuple], dict] = {}
    for r in rows:   # the last row of a (point, column) wins (a re-run overrides)
        best[(r["batch"], r["mode"], (1, "") if r["tp"] == 1 else (r["tp"], _col(r)))] = r
    lines = ["| batch | mode | TP=1 tok/s | " + " | ".join(f"TP={tp} {c}" for tp, c in cols)
             + "".join(f" | best TP={tp} / TP=1" for tp in sizes) + " |",
             "|---|---|---|" + "---|" * (len(cols) + len(sizes))]
    curve: dict[tuple[int, str], dict[int, float]] = {}
    for b, mode in points:
        one = best.get((b, mode, (1, "")))
        cells = [best.get((b, mode, c)) for c in cols]
        tops = {tp: max((c["tokens_per_s"] for c, (t, _) in zip(cells, cols) if c and t == tp),
                        default=None) for tp in sizes}
        ratios = [f"{tops[tp] / one['tokens_per_s']:.2f}x" if one and tops[tp] else "-"
                  for tp in sizes]
        lines.append(f"| {b} | {mode} | {_cell(one)} | " + " | ".join(_cell(c) for c in cells)
                     + "".join(f" | {x}" for x in ratios) + " |")
        curve[(b, mode)] = {tp: tok for tp, tok in ([(1, one["tokens_per_s"] if one else None)]
                                                   + list(tops.items())) if tok}
    for r in rows:
        if "profile" in r:
            p = r["profile"]
            lines.append(f"profile tp={r['tp']} {_col(r)} {r['mode']} b={r['batch']}: "
                         f"collectives/step {p['collectives_per_step']}; ms/step by kind "
                         f"{p['ms_by_kind']}")
    if allreduce is not None:
        lines.append(f"allreduce checks: {'PASS' if allreduce.get('ok') else 'FAIL'} "
                     f"({allreduce.get('setup')})")
    text = "\n".join(lines)
    print(text, flush=True)
    result = {"rows": rows, "allreduce": allreduce, "table": text,
              "curve": [{"batch": b, "mode": m, "tokens_per_s": {str(k): v for k, v in c.items()}}
                        for (b, m), c in curve.items()]}
    if args.results:
        args.results.write_text(json.dumps(result, indent=1))
    png = (args.results.parent if args.results else args.out) / "tp_curve.png"
    if plot_curve(curve, png):
        print(f"curve: {png}", flush=True)
    return result


def plot_curve(curve: dict[tuple[int, str], dict[int, float]], path: Path) -> bool:
    """Best tok/s at each TP size per (batch, mode), and the speed-up over TP=1 against
    the ideal (TP=N: N times); False without matplotlib or with one TP size only."""
    lines = {k: sorted(v.items()) for k, v in curve.items() if len(v) > 1}
    if not lines:
        return False
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (tok_ax, up_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    sizes = sorted({tp for pts in lines.values() for tp, _ in pts})
    for (b, mode), pts in lines.items():
        tps, toks = zip(*pts)
        tok_ax.plot(tps, toks, marker="o", label=f"B={b} {mode}")
        if pts[0][0] == 1:
            up_ax.plot(tps, [t / toks[0] for t in toks], marker="o", label=f"B={b} {mode}")
    up_ax.plot(sizes, sizes, linestyle="--", color="grey", label="ideal")
    for ax, label in ((tok_ax, "decode tokens/s (best setting)"),
                      (up_ax, "speed-up over TP=1")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    tok_ax.set_yscale("log")
    up_ax.legend(fontsize=8)
    fig.suptitle("Decode at TP=1/2/4, Llama-3-8B shape, bf16, rank-16 adapters")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _col(r: dict) -> str:
    ar = "1shot" if r["in_use"].startswith("one-shot") else {"auto": "nccl/gloo"}.get(
        r["allreduce"], r["allreduce"])
    return f"{ar} async {'on' if r['async'] else 'off'}"


def _cell(r: dict | None) -> str:
    return "-" if r is None else f"{r['tokens_per_s']:,.0f} ({r['step_ms']:.2f} ms)"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("allreduce", "parity", "decode", "table"))
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--out", type=Path, required=True, help="table: the JSON directory read")
    ap.add_argument("--results", type=Path, help="table: every row and the table, as JSON")
    ap.add_argument("--eager", action="store_true")
    ap.add_argument("--allreduce", default="auto", choices=("auto", "nccl", "symm_mem"))
    ap.add_argument("--async-scheduling", type=_async_list, default=["auto"],
                    help="decode: auto|on|off, or several (on,off): each batch is timed "
                         "with each, on one engine")
    ap.add_argument("--profile", action="store_true",
                    help="decode: profile 5 steps at --profile-batches x --profile-modes")
    ap.add_argument("--profile-batches", type=_ints, default=[64])
    ap.add_argument("--profile-modes", type=lambda s: s.split(","), default=["base", "distinct"])
    ap.add_argument("--device", default="cuda", help="cpu: on gloo (decode: the tiny test "
                    "model, a check of this script)")
    ap.add_argument("--dtype", default="bfloat16", help="parity only")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="allreduce: seconds before the two ranks are killed (keep it under "
                         "any outer timeout, so that no rank outlives this process)")
    ap.add_argument("--steps", type=int, default=12, help="decode: steps per timed run")
    ap.add_argument("--repeats", type=int, default=3, help="decode: timed runs per point")
    ap.add_argument("--batches", type=_ints, default=[1, 64])
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["base", "one", "distinct"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.phase == "table":
        table(args)
        return
    if args.phase == "allreduce":
        from benchmarks.tp_allreduce import run
        result = run(args.out, size=args.tp, timeout_s=args.timeout)
    else:
        result = parity(args) if args.phase == "parity" else decode(args)
    (args.out / f"{_tag(args)}.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=1), flush=True)
    if args.phase in ("allreduce", "parity") and not result.get("ok"):
        sys.exit(1)
    if args.phase == "decode" and args.device == "cuda":
        # the results are out and the engine closed: the interpreter's own teardown of
        # NCCL must neither decide nor stall this phase
        sys.stderr.flush()
        os._exit(0)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _async_list(text: str) -> list[str]:
    values = text.split(",")
    bad = [v for v in values if v not in ASYNC]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad}: each value is auto, on or off")
    return values


if __name__ == "__main__":
    main()
