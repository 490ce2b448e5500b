"""The greedy pick (each row's argmax token and its raw logprob) of a decode step's
logits: the torch ops (kernels/greedy_pick_ref.py: float32 copy, argmax, log_softmax,
gather) against the Triton kernel (kernels/greedy_pick_triton.py: one read), on
Llama-3's vocabulary (128256) for batch sizes 1 to 256, against the floor of reading the
logits once.

    python -m benchmarks.kernels greedy-pick --out DIR [--dtype bfloat16] [--chunks 2048,4096,8192]

Each path is checked against the torch ops first (same tokens, logprobs within 1e-5;
random logits with a tie placed across chunks), then timed in CUDA graphs over rotating
logits buffers (benchmarks/common.py: an L2 cannot hold them; in the engine the logits
come straight from lm_head, so a small batch's may still sit in L2 there). The Triton
path runs once per --chunks entry (values per program; the engine's: CHUNK). Writes
greedy_pick.csv to DIR and prints a table. Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import (copy_bandwidth, count_launches, floor_seconds,  # noqa: E402
                               rotating_sets, time_graph, write_csv)

VOCAB = 128256


def make_logits(B: int, V: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random logits (lm_head-like spread), each row's max placed twice: at index 4100 and
    near the end (the first must win)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(B, V, device="cuda", generator=g) * 3).to(dtype)
    x[:, [min(V - 1, 4100), V - 7]] = x.float().amax(dim=1, keepdim=True).to(dtype) + 1
    return x


def check(got: torch.Tensor, want: torch.Tensor, name: str) -> float:
    """Fails unless the tokens are equal; returns the largest logprob difference."""
    assert torch.equal(got[0], want[0]), f"{name}: tokens differ from the torch ops"
    diff = float((got[1] - want[1]).abs().max())
    assert diff < 1e-5, f"{name}: logprobs differ by {diff}"
    return diff


def run(B: int, dtype: torch.dtype, chunks: list[int], bw: float) -> dict:
    from loramux_kernels.greedy_pick_ref import greedy_pick_ref
    from loramux_kernels.greedy_pick_triton import greedy_pick
    first = make_logits(B, VOCAB, dtype, seed=B)
    want = greedy_pick_ref(first)
    sets = [first] + [make_logits(B, VOCAB, dtype, seed=B + i)
                      for i in range(1, rotating_sets(first.nbytes))]
    paths = {"torch": greedy_pick_ref}
    paths.update({f"triton{c}": (lambda x, c=c: greedy_pick(x, chunk=c)) for c in chunks})
    row = {"batch": B, "dtype": str(dtype).removeprefix("torch."),
           "floor_us": floor_seconds(first.nbytes, bw, 0) * 1e6}
    for name, fn in paths.items():
        diff = check(fn(first), want, name)
        calls = [lambda x=x, fn=fn: fn(x) for x in sets]
        row[f"{name}_us"] = time_graph(calls) * 1e6
        row[f"{name}_launches"] = count_launches(calls[0])
        row[f"{name}_max_lp_diff"] = diff
    return row


def main(argv: list[str] | None = None) -> int:
    from loramux_kernels.greedy_pick_triton import CHUNK
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--chunks", default=str(CHUNK),
                   help="comma list of vocabulary values per Triton program (powers of two)")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, args.dtype)
    chunks = [int(c) for c in args.chunks.split(",")]
    bw = copy_bandwidth()
    print(f"device {torch.cuda.get_device_name()} copy bandwidth {bw / 1e12:.2f} TB/s",
          flush=True)
    rows = []
    for B in (int(b) for b in args.batches.split(",")):
        rows.append(run(B, dtype, chunks, bw))
        r = rows[-1]
        print(f"B={B:4d}: torch {r['torch_us']:7.1f} us ({r['torch_launches']}) "
              + " ".join(f"triton/{c} {r[f'triton{c}_us']:6.1f} us ({r[f'triton{c}_launches']})"
                         for c in chunks)
              + f" floor {r['floor_us']:5.1f} us", flush=True)
    write_csv(args.out / "greedy_pick.csv", rows)
    heads = " | ".join(f"triton chunk {c} us (launches)" for c in chunks)
    print(f"\n| batch | floor us | torch us (launches) | {heads} |\n|"
          + "---|" * (3 + len(chunks)))
    for r in rows:
        cells = " | ".join(f"{r[f'triton{c}_us']:.1f} ({r[f'triton{c}_launches']})"
                           for c in chunks)
        print(f"| {r['batch']} | {r['floor_us']:.1f} | {r['torch_us']:.1f} "
              f"({r['torch_launches']}) | {cells} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
