"""Mixture-of-experts layer benchmark on Qwen1.5-MoE-A2.7B shapes (hidden 2048, 60 experts,
top 4, expert width 1408): the Triton grouped-GEMM path (kernels/moe_triton.py), alone and
with expert LoRA (4 slots of rank 16, tokens spread over them and base), against a bf16
loop over the experts present as transformers runs them, across token counts.

    python benchmarks/bench_moe.py --out DIR [--quick]

Measures the device copy bandwidth in the same run; for every case checks the Triton
result against the float32 torch reference (kernels/moe_ref.py) first, then times
(triton.testing.do_bench, median, L2 flushed). The floor is the expert weights the batch
touches read once (distinct experts x 3 x hidden x width x 2 bytes; LoRA factors left
out), divided by the measured bandwidth. Writes moe.csv to DIR and prints a short table.
Needs CUDA.
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import copy_bandwidth, time_do_bench  # noqa: E402
from kernels import moe, moe_triton  # noqa: E402
from kernels.moe_ref import route_ref  # noqa: E402

HIDDEN, EXPERTS, TOP_K, INTER = 2048, 60, 4, 1408
SLOTS, RANK = 4, 16


def make_case(T: int, lora: bool, gen: torch.Generator, dev: str = "cuda"):
    bf16 = torch.bfloat16
    x = torch.randn(T, HIDDEN, device=dev, dtype=bf16, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device=dev, dtype=bf16, generator=gen) * HIDDEN ** -0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device=dev, dtype=bf16, generator=gen) * INTER ** -0.5
    logits = torch.randn(T, EXPERTS, device=dev, generator=gen)
    weights, ids = route_ref(logits, TOP_K, norm_topk_prob=False)
    weights = weights.to(bf16)
    exp_lora = None
    if lora:
        slots = torch.randint(-1, SLOTS, (T,), device=dev, generator=gen)
        def f(*shape):
            return torch.randn(*shape, device=dev, dtype=bf16, generator=gen) * 0.05
        exp_lora = moe.ExpertLoRA(slots, f(SLOTS, EXPERTS, RANK, HIDDEN),
                                  f(SLOTS, EXPERTS, 2 * INTER, RANK),
                                  f(SLOTS, EXPERTS, RANK, INTER), f(SLOTS, EXPERTS, HIDDEN, RANK))
    return x, w13, w2, weights, ids, exp_lora


def floor_bytes(ids: torch.Tensor) -> int:
    """The expert weights the batch routes to, read once (bf16)."""
    return int(torch.unique(ids).numel()) * 3 * HIDDEN * INTER * 2


def hf_loop(x, w13, w2, weights, ids):
    """transformers' Qwen2MoeExperts.forward: one pair of matmuls per expert hit."""
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        tok, j = torch.where(ids == e)
        gate, up = torch.nn.functional.linear(x[tok], w13[e]).chunk(2, dim=-1)
        y = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, w2[e])
        out.index_add_(0, tok, y * weights[tok, j, None])
    return out


def _checked(T, lora, gen, dev="cuda"):
    case = make_case(T, lora, gen, dev)
    ref = moe._run(None, *case)
    got = moe._run(moe_triton, *case)
    err = float((got.float() - ref.float()).norm() / ref.float().norm())
    assert err < 3e-2, f"T={T} lora={lora}: relative error {err:.3g} against the reference"
    return case, err


def run(out_dir: Path, quick: bool) -> list[dict]:
    bw = copy_bandwidth()
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for T in ([1, 64, 512] if quick else [1, 8, 32, 64, 128, 256, 512, 2048]):
        (x, w13, w2, weights, ids, _), err = _checked(T, False, gen)
        lora_case, lora_err = _checked(T, True, gen)
        t_triton = time_do_bench(lambda: moe._run(moe_triton, x, w13, w2, weights, ids, None))
        t_lora = time_do_bench(lambda: moe._run(moe_triton, *lora_case))
        t_hf = time_do_bench(lambda: hf_loop(x, w13, w2, weights, ids))
        floor = floor_bytes(ids) / bw
        rows.append(dict(tokens=T, triton_us=t_triton * 1e6, triton_lora_us=t_lora * 1e6,
                         lora_overhead_pct=100 * (t_lora / t_triton - 1),
                         hf_loop_us=t_hf * 1e6, speedup_vs_hf=t_hf / t_triton,
                         floor_us=floor * 1e6, pct_of_floor=100 * floor / t_triton,
                         rel_err=max(err, lora_err)))
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "moe.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; {torch.cuda.get_device_name()}")
    print(f"{'tokens':>6} {'triton us':>10} {'+LoRA us':>9} {'LoRA %':>7} {'HF loop us':>11} "
          f"{'speedup':>8} {'floor us':>9} {'% floor':>8}")
    for r in rows:
        print(f"{r['tokens']:>6} {r['triton_us']:>10.1f} {r['triton_lora_us']:>9.1f} "
              f"{r['lora_overhead_pct']:>6.1f}% {r['hf_loop_us']:>11.1f} "
              f"{r['speedup_vs_hf']:>8.2f} {r['floor_us']:>9.1f} {r['pct_of_floor']:>7.1f}%")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    run(args.out, args.quick)


if __name__ == "__main__":
    main()
