"""The add + RMSNorm + LoRA shrink launch (kernels/lora/norm_shrink.py) and the
SiLU-and-multiply + shrink launch (kernels/lora/silu_shrink.py) against the engine's
separate path, per layer group on Llama-3-8B shapes (bf16, rank 16).

    python benchmarks/bench_norm_shrink.py --out DIR [--quick] [--sweep]

For q/k/v and gate/up (both read the hidden state after a norm) and down (reads the
activation), token counts 1 to 256 and one adapter for every row ("one", the uniform
launch parameters) or one adapter per row over up to 64 adapters ("distinct"): path
"separate" is the add + RMSNorm (or SiLU) kernel then `add_lora` (shrink and expand, or
the mixed kernels where their table says), path "fused" the fused launch then the expand
(with the 1/rms row scale after a norm). Each is checked against the
other first, then timed in CUDA graphs over rotating buffer sets (benchmarks/common.py),
with its launch count. Writes norm_shrink.csv to DIR and prints a table. --sweep also
times the fused path's launch parameters (warps, K step, K split) on one-adapter batches
(norm_shrink_sweep.csv). Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import count_launches, rotating_sets, time_graph, write_csv  # noqa: E402

HIDDEN, KV, INTER, RANK, EPS = 4096, 1024, 14336, 16, 1e-5
GROUPS = {"qkv": (HIDDEN, KV, KV), "gate_up": (INTER, INTER), "down": (HIDDEN,)}
K_IN = {"qkv": HIDDEN, "gate_up": HIDDEN, "down": INTER}
MAX_ADAPTERS = 64


def make_set(group: str, T: int, mapping: str, seed: int) -> dict:
    """Random bf16 activations (down: [gate | up]), residual, norm weight, output and an
    adapter pool."""
    from loramux_kernels.lora.launch import build_meta
    N, K = GROUPS[group], K_IN[group]
    L = 1 if mapping == "one" else min(T, MAX_ADAPTERS)
    g = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=g)
    a = (torch.randn(L, len(N), RANK, K, **kw) / K ** 0.5).bfloat16()
    b = (torch.randn(L, sum(N), RANK, **kw) / RANK ** 0.5).bfloat16()
    ts = torch.arange(T, device="cuda") % L
    offsets = tuple(int(v) for v in torch.tensor((0,) + N).cumsum(0))
    return dict(x=torch.randn(T, 2 * K if group == "down" else K, **kw).bfloat16(),
                res=(torch.randn(T, HIDDEN, **kw) * 4).bfloat16(),
                w=(1 + torch.randn(HIDDEN, **kw) / 8).bfloat16(),
                y=torch.randn(T, sum(N), **kw).bfloat16(), a=a, b=b, ts=ts,
                ranks=torch.full((L,), RANK, dtype=torch.int32, device="cuda"),
                offsets=offsets, meta=build_meta(ts, L), uniform=mapping == "one")


def separate(s: dict, res: torch.Tensor, y: torch.Tensor):
    """The engine's path with the switch off: add + RMSNorm (down: SiLU-and-multiply),
    then shrink and expand."""
    from loramux_kernels.elementwise_triton import add_rms_norm, silu_mul
    from loramux_kernels.lora.launch import add_lora
    out = silu_mul(s["x"]) if s["a"].shape[-1] == INTER else \
        add_rms_norm(s["x"], res, s["w"], EPS)[0]
    add_lora(y, out, s["a"], s["b"], s["ts"], s["offsets"], s["ranks"], s["meta"],
             uniform=s["uniform"])
    return out


def fused(s: dict, res: torch.Tensor, y: torch.Tensor, **launch):
    """With the switch on: the norm (down: SiLU) and the shrink in one launch, then the
    expand."""
    from loramux_kernels.lora.norm_shrink import add_rms_norm_shrink, expand_fused_shrunk
    from loramux_kernels.lora.silu_shrink import silu_mul_shrink
    if s["a"].shape[-1] == INTER:
        out, shrunk = silu_mul_shrink(s["x"], s["a"], s["ts"], s["offsets"], s["ranks"],
                                      uniform=s["uniform"], **launch)
    else:
        out, _, shrunk = add_rms_norm_shrink(s["x"], res, s["w"], EPS, s["a"], s["ts"],
                                             s["offsets"], s["ranks"], uniform=s["uniform"],
                                             **launch)
    expand_fused_shrunk(shrunk, s["b"], y, s["meta"])
    return out


PATHS = {"separate": separate, "fused": fused}


def check(s: dict) -> None:
    """Both paths give the same normed rows and LoRA deltas (bf16 tolerance)."""
    got = {}
    for name, fn in PATHS.items():
        y = s["y"].clone()
        out = fn(s, s["res"].clone(), y)
        got[name] = (out.float(), (y.float() - s["y"].float()))
    torch.testing.assert_close(got["fused"][0], got["separate"][0], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(got["fused"][1], got["separate"][1], atol=6e-2, rtol=3e-2)
    assert got["fused"][1].abs().max() > 0.1


def run(group: str, T: int, mapping: str) -> dict:
    first = make_set(group, T, mapping, seed=0)
    check(first)
    per_set = sum(t.nbytes for t in first.values() if isinstance(t, torch.Tensor))
    sets = [first] + [make_set(group, T, mapping, seed=i)
                      for i in range(1, rotating_sets(per_set))]
    row = {"group": group, "tokens": T, "mapping": mapping}
    for name, fn in PATHS.items():
        calls = [lambda s=s, fn=fn: fn(s, s["res"], s["y"]) for s in sets]
        row[f"{name}_us"] = time_graph(calls) * 1e6
        row[f"{name}_launches"] = count_launches(calls[0])
    row["saved_us"] = row["separate_us"] - row["fused_us"]
    return row


# (num_warps, block_k, splits); None: the default
SWEEP = [(4, None, None), (8, None, None), (4, 32, None), (4, 128, None), (8, 128, None),
         (4, None, 4), (4, None, 16), (8, None, 16)]


def sweep(group: str, T: int) -> list[dict]:
    """The fused path's launch parameters on a one-adapter batch, each checked first
    against the separate path."""
    sets = [make_set(group, T, "one", seed=i) for i in range(4)]
    s0 = sets[0]
    y0 = s0["y"].clone()                 # the timed calls add into s0["y"]
    want = y0.clone()
    separate(s0, s0["res"].clone(), want)
    rows = []
    for warps, block_k, splits in SWEEP:
        launch = dict(num_warps=warps, block_k=block_k, splits=splits)
        got = y0.clone()
        fused(s0, s0["res"].clone(), got, **launch)
        torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=3e-2)
        calls = [lambda s=s: fused(s, s["res"], s["y"], **launch) for s in sets]
        rows.append({"group": group, "tokens": T, "num_warps": warps,
                     "block_k": block_k or "default", "splits": splits or "default",
                     "fused_us": time_graph(calls) * 1e6})
        print(f"sweep {group:8s} T={T:4d} warps {warps} block_k {block_k} splits {splits}: "
              f"{rows[-1]['fused_us']:6.1f} us", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="1 and 64 tokens only")
    p.add_argument("--sweep", action="store_true", help="also the fused launch parameters")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = (1, 64) if args.quick else (1, 4, 16, 32, 64, 128, 256)
    print(f"device {torch.cuda.get_device_name()}", flush=True)
    rows = []
    for group in GROUPS:
        for mapping in ("one", "distinct"):
            for T in tokens:
                if mapping == "distinct" and T == 1:
                    continue
                rows.append(run(group, T, mapping))
                r = rows[-1]
                print(f"{group:8s} {mapping:8s} T={T:4d}: separate {r['separate_us']:6.1f} us "
                      f"({r['separate_launches']}) fused {r['fused_us']:6.1f} us "
                      f"({r['fused_launches']})", flush=True)
    write_csv(args.out / "norm_shrink.csv", rows)
    print("\n| group | mapping | tokens | separate us (launches) | fused us (launches) | "
          "saved us |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['group']} | {r['mapping']} | {r['tokens']} | {r['separate_us']:.1f} "
              f"({r['separate_launches']}) | {r['fused_us']:.1f} ({r['fused_launches']}) | "
              f"{r['saved_us']:.1f} |")
    if args.sweep:
        found = [r for group in GROUPS for T in (1, 16, 64) for r in sweep(group, T)]
        write_csv(args.out / "norm_shrink_sweep.csv", found)
    return 0


if __name__ == "__main__":
    sys.exit(main())
