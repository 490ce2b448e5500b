"""One prefill of N tokens (default 512) on the CPU: the engine against Hugging Face
transformers on the same model and prompt.

    python benchmarks/experiments/bench_cpu_prefill.py [--model DIR] [--tokens 512] [--out DIR]

Without --model it uses the demo model (services/demo_model.py, made in a temporary
directory). The engine runs the prompt as one step (max_num_batched_tokens >= N, prefix
caching off so every repetition computes) and samples one token; Hugging Face runs one
forward pass of the same ids in float32 with torch's default attention. Both use the same
torch thread count (the engine's default, printed). Prints the median of --reps runs of
each and the ratio; writes cpu_prefill.json to --out when given.
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

sys.path.append(str(Path(__file__).resolve().parents[2]))  # last: hides nothing installed
from benchmarks.common import report  # noqa: E402


def time_engine(model: str, ids: list[int], reps: int) -> tuple[float, str]:
    from loramux_engine import Engine, EngineConfig, SamplingParams

    eng = Engine(EngineConfig(model=model, device="cpu", dtype="float32",
                              max_num_batched_tokens=max(512, len(ids)),
                              max_model_len=len(ids) + 8, enable_prefix_caching=False))
    params = SamplingParams(temperature=0.0, max_tokens=1)
    times = []
    for _ in range(reps + 1):  # the first run warms up
        t0 = time.perf_counter()
        eng.generate([ids], params)
        times.append(time.perf_counter() - t0)
    desc = eng.describe()
    eng.close()
    return statistics.median(times[1:]), desc


def time_hf(model: str, ids: list[int], reps: int) -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    x = torch.tensor([ids])
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            hf(x, use_cache=False, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF model dir (default: the demo model)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None, help="directory for cpu_prefill.json")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from loramux_services.demo_model import ensure_demo
        model = str(ensure_demo(tempfile.mkdtemp(prefix="bench-cpu-prefill-")))
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.tokens,), generator=g).tolist()
    ours, desc = time_engine(model, ids, args.reps)
    threads = torch.get_num_threads()  # as the engine set it
    theirs = time_hf(model, ids, args.reps)
    result = {"tokens": args.tokens, "engine_s": ours, "hf_s": theirs, "ratio": ours / theirs,
              "torch_threads": threads, "engine_config": desc, "model": model}
    print(f"engine: {desc}")
    report(args.out, "cpu_prefill.json", result, {
        "prefill tokens": str(args.tokens), "torch threads": str(threads),
        "engine (ms)": f"{ours * 1e3:.1f}", "transformers (ms)": f"{theirs * 1e3:.1f}",
        "engine / HF": f"{ours / theirs:.2f}x"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
