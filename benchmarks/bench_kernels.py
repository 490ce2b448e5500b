"""Multi-adapter LoRA kernel benchmark on Llama-3-8B shapes against the memory floor.

    python benchmarks/bench_kernels.py --out DIR [--quick | --targets | --uniform | --prefill
                                                  | --planner [--tiny]]

Measures the device copy bandwidth in the same run, then for every layer group (qkv, o,
gate_up, down), rank, token count, distinct-adapter count and token->adapter mapping:
checks `add_lora` against the torch reference on sampled rows, times it with CUDA graphs
over rotating buffer sets, counts its launches, and (on the two-kernel path) times the
shrink and expand kernels alone. One-adapter cases up to 256 tokens run as the engine's
uniform graph launches them: path "two-launch" (the token kernels); cases of several
adapters and 17-256 tokens twice: path "tokens" (the token kernels) and "segments"
(kernels/lora/mixed.py), side by side; cases above 256 tokens (the prefill path): path
"tiles" (the tile-list grouped GEMM, kernels/lora/segment.py). Which path the engine takes
is kernels/lora/plan.py's; `--planner` times every form on that planner's grid
(benchmarks/plan_grid.py, which also runs on the CPU with --tiny). Floors follow
PERF.md. Writes kernels.csv and kernels.md to DIR and prints a short table. Needs a CUDA
GPU; the arithmetic helpers do not.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.common import (count_launches, copy_bandwidth, floor_seconds,  # noqa: E402
                               rotating_sets, time_graph)

HIDDEN, KV, INTER = 4096, 1024, 14336
BF16, FP32 = 2, 4


def layer_groups() -> list[tuple[str, int, tuple[int, ...]]]:
    """(name, input width K, output slice widths) of the LoRA-wrapped layers of one block."""
    return [("qkv", HIDDEN, (HIDDEN, KV, KV)), ("o", HIDDEN, (HIDDEN,)),
            ("gate_up", HIDDEN, (INTER, INTER)), ("down", INTER, (HIDDEN,))]


def shrink_floor_bytes(M: int, K: int, S: int, r: int, L: int, b: int = BF16,
                       c: int = FP32) -> int:
    """x read once, A of every used adapter once, h written (PERF.md)."""
    return M * K * b + L * S * r * K * b + S * M * r * c


def expand_floor_bytes(M: int, N: tuple[int, ...], r: int, L: int, b: int = BF16,
                       c: int = FP32) -> int:
    """h read, B of every used adapter once, y read and written (PERF.md)."""
    return len(N) * M * r * c + L * sum(N) * r * b + 2 * M * sum(N) * b


def token_slots_for(T: int, L: int, mapping: str, device) -> torch.Tensor:
    """T tokens over L adapters (each used when T >= L): runs in slot order ("contiguous",
    as requests arrive in prefill) or the same multiset shuffled ("random")."""
    slots = torch.arange(T) * L // T
    if mapping == "random":
        slots = slots[torch.randperm(T)]
    return slots.to(device)


@dataclass(frozen=True)
class Case:
    group: str
    rank: int
    tokens: int
    adapters: int
    mapping: str
    # one adapter up to 256 tokens: "two-launch" (uniform decode path); several: "tokens"
    # or "segments"; above 256 tokens: "tiles" (prefill path); else "-"
    path: str = "-"


UNIFORM_PATHS = ("two-launch",)
MIXED_PATHS = ("tokens", "segments")     # several adapters, 17..256 tokens: old and new
SEGMENT_PATHS = ("tiles",)               # above 256 tokens (prefill)


@contextlib.contextmanager
def mixed_path(path: str):
    """A mixed decode batch takes `path` inside the block (else: the table's choice)."""
    from loramux_kernels.lora import plan
    old = plan.FORCED
    if path in MIXED_PATHS:
        plan.FORCED = {"segments": plan.MIXED}.get(path, path)
    try:
        yield
    finally:
        plan.FORCED = old


@dataclass(frozen=True)
class Result:
    group: str
    rank: int
    tokens: int
    adapters: int
    mapping: str
    path: str
    launches: int
    us: float
    floor_us: float
    gbps: float
    pct_floor: float
    shrink_us: float
    shrink_pct: float
    expand_us: float
    expand_pct: float
    gemm_us: float = float("nan")        # --uniform: the group's base matmul alone ...
    with_gemm_us: float = float("nan")   # ... and followed (or, ahead, overlapped) by LoRA


def cases(quick: bool, targets: bool = False, uniform: bool = False,
          prefill: bool = False) -> list[Case]:
    groups = ["qkv", "down"] if quick else [g[0] for g in layer_groups()]
    ranks = [16] if quick or targets or uniform or prefill else [8, 16, 32, 64, 128]
    tokens = [1, 64, 1024] if quick else [1, 16, 64, 256, 1024, 8192]
    adapters = [1, 8] if quick else [1, 8, 64, 128]
    if targets:  # the target points: every group, rank 16 (T 128/256: decode, L 64)
        tokens, adapters = [1, 16, 64, 128, 256, 8192], [1, 64]
    if uniform:  # one adapter at decode sizes, both paths
        tokens, adapters = ([1, 64] if quick else [1, 16, 64]), [1]
    if prefill:  # one chunk of prefill over 64 adapters, both prefill paths
        tokens, adapters = [8192], [64]
    out = []
    for g in groups:
        for r in ranks:
            for t in tokens:
                for n in adapters:
                    if n > t:
                        continue
                    maps = ["contiguous", "random"] if n > 1 and t > 1 and not prefill else [
                        "contiguous"]
                    for m in maps:
                        paths = (UNIFORM_PATHS if n == 1 and t <= 256 else
                                 MIXED_PATHS if 16 < t <= 256 else
                                 SEGMENT_PATHS if t > 256 else ("-",))
                        out.extend(Case(g, r, t, n, m, p) for p in paths)
    return out


def make_set(case: Case, seed: int):
    """One buffer set: random bf16 activations, output and an L-slot pool of rank r."""
    from loramux_kernels.lora.launch import build_meta
    _, K, N = next(g for g in layer_groups() if g[0] == case.group)
    g = torch.Generator(device="cuda").manual_seed(seed)
    L, S, r, T = case.adapters, len(N), case.rank, case.tokens
    kw = dict(device="cuda", generator=g)
    a = (torch.randn(L, S, r, K, **kw) / K ** 0.5).bfloat16()
    b = (torch.randn(L, sum(N), r, **kw) / r ** 0.5).bfloat16()
    x = torch.randn(T, K, **kw).bfloat16()
    y = torch.randn(T, sum(N), **kw).bfloat16()
    ts = token_slots_for(T, L, case.mapping, "cuda")
    ranks = torch.full((L,), r, dtype=torch.int32, device="cuda")
    offsets = tuple(int(v) for v in torch.tensor((0,) + N).cumsum(0))
    return dict(x=x, y=y, a=a, b=b, ts=ts, ranks=ranks, offsets=offsets,
                meta=build_meta(ts, L))


def check(s, uniform: bool = False, path: str = "-") -> None:
    """add_lora on all tokens equals the reference on sampled rows (tokens are
    independent)."""
    from loramux_kernels.lora.launch import add_lora
    from loramux_kernels.lora.reference import add_lora_ref
    T = s["x"].shape[0]
    rows = torch.unique(torch.cat([torch.arange(min(T, 64)), torch.randperm(T)[:64]])).cuda()
    got = add_lora(s["y"].clone(), s["x"], s["a"], s["b"], s["ts"], s["offsets"],
                   s["ranks"], s["meta"], uniform=uniform)[rows]
    want = add_lora_ref(s["y"][rows].clone(), s["x"][rows], s["a"], s["b"], s["ts"][rows],
                        s["offsets"])
    torch.testing.assert_close(got.float(), want.float(), atol=6e-2, rtol=3e-2)


def run_case(case: Case, bw: float, gemm: bool = False) -> Result:
    """gemm: also time the group's base matmul alone and with the LoRA after it."""
    with mixed_path(case.path):
        res = _run_case(case, bw)
        if gemm:
            res = replace(res, **_with_gemm(case))
        return res


def _lora_call(s, matmul=None):
    """One group's LoRA on buffer set s (after `matmul`, if given, as the engine does)."""
    from loramux_kernels.lora.launch import add_lora
    uniform = s["a"].shape[0] == 1

    def run():
        if matmul is not None:
            matmul(s)
        add_lora(s["y"], s["x"], s["a"], s["b"], s["ts"], s["offsets"], s["ranks"],
                 s["meta"], uniform=uniform)
    return run


def _with_gemm(case: Case) -> dict:
    """{gemm_us, with_gemm_us}: y = x·Wᵀ (random bf16 W of the group's shape, shared by
    the rotating sets: it alone is larger than the L2) alone, and followed by LoRA."""
    _, K, N = next(g for g in layer_groups() if g[0] == case.group)
    sets = [make_set(case, seed) for seed in range(4)]
    key = (case.group, case.tokens)
    if key not in _GEMM:      # W and the matmul alone: the same for every path
        _GEMM.clear()
        w = torch.randn(sum(N), K, device="cuda").bfloat16()
        _GEMM[key] = (w, time_graph([lambda s=s: torch.matmul(s["x"], w.t(), out=s["y"])
                                     for s in sets]))
    w, t_gemm = _GEMM[key]

    def matmul(s):
        torch.matmul(s["x"], w.t(), out=s["y"])
    t_both = time_graph([_lora_call(s, matmul) for s in sets])
    return dict(gemm_us=t_gemm * 1e6, with_gemm_us=t_both * 1e6)


_GEMM: dict = {}


def _run_case(case: Case, bw: float) -> Result:
    _, K, N = next(g for g in layer_groups() if g[0] == case.group)
    M, r, L, S = case.tokens, case.rank, case.adapters, len(N)
    per_set = M * K * BF16 + L * S * r * K * BF16 + L * sum(N) * r * BF16 + M * sum(N) * BF16
    sets = [make_set(case, seed) for seed in range(rotating_sets(per_set))]
    check(sets[0], uniform=L == 1, path=case.path)
    launches = count_launches(_lora_call(sets[0]))   # one adapter: as a uniform graph's
    t = time_graph([_lora_call(s) for s in sets])
    nbytes = shrink_floor_bytes(M, K, S, r, L) + expand_floor_bytes(M, N, r, L)
    floor = floor_seconds(nbytes, bw, launches)
    res = dict(shrink_us=float("nan"), shrink_pct=float("nan"),
               expand_us=float("nan"), expand_pct=float("nan"))
    shrink, expand = _two_kernels(sets[0], M, L)
    if case.path == "two-launch":   # the one-adapter token kernels alone (uniform launch)
        shrink, expand = _token_kernels(len(N), uniform=True)
    if case.path == "tokens":       # the mixed batch's token kernels alone (the old path)
        shrink, expand = _token_kernels(len(N), uniform=False)
    if case.path in SEGMENT_PATHS:  # the prefill path's kernels alone (tile list or not)
        shrink, expand = segment_kernels(case.path, K)
    if shrink is not None:
        hs = [shrink(s) for s in sets]
        ts = time_graph([lambda s=s: shrink(s) for s in sets])
        te = time_graph([lambda s=s, h=h: expand(s, h) for s, h in zip(sets, hs)])
        sf = floor_seconds(shrink_floor_bytes(M, K, S, r, L), bw, 1)
        ef = floor_seconds(expand_floor_bytes(M, N, r, L), bw, 1)
        res = dict(shrink_us=ts * 1e6, shrink_pct=100 * sf / ts,
                   expand_us=te * 1e6, expand_pct=100 * ef / te)
    return Result(**asdict(case), launches=launches, us=t * 1e6, floor_us=floor * 1e6,
                  gbps=nbytes / t / 1e9, pct_floor=100 * floor / t, **res)


def segment_kernels(path: str, K: int):
    """(shrink(set) -> h, expand(set, h)) of one prefill path with add_lora's parameters."""
    from loramux_kernels.lora.segment import config_for, seg_expand, seg_shrink
    cfg = config_for(torch.device("cuda"), K)
    return (lambda s: seg_shrink(s["x"], s["a"], s["meta"], s["ranks"]),
            lambda s, h: seg_expand(h, s["b"], s["y"], s["meta"], s["offsets"], s["ranks"],
                                    cfg=cfg))


def _token_kernels(S: int, uniform: bool):
    """(shrink(set), expand(set, h)) of the token kernels (the two-launch one-adapter path
    with `uniform`), to time alone."""
    from loramux_kernels.lora.token import _offsets, lora_expand_tokens, lora_shrink_tokens

    def shrink(s):
        return lora_shrink_tokens(s["x"], s["a"], s["meta"], s["ranks"], uniform=uniform)

    def expand(s, h):
        return lora_expand_tokens(h, s["b"], s["y"], s["meta"], _offsets(s["offsets"]), S,
                                  s["ranks"], uniform=uniform)
    return shrink, expand


def _two_kernels(s, M: int, L: int):
    """(shrink(set), expand(set, h)) of the two-kernel path add_lora takes for this case,
    to time alone: the prefill kernels above the decode path, the mixed decode kernels
    where their table sends the shape; (None, None) otherwise."""
    from loramux_kernels.lora import mixed
    from loramux_kernels.lora import plan as planner
    offsets = s["offsets"]
    widest = max(hi - lo for lo, hi in zip(offsets, offsets[1:]))
    path = planner.choose(s["x"].device, M, L == 1, False, len(offsets) - 1, s["x"].shape[1],
                          widest, s["a"].shape[2])
    if path == planner.TILES:
        return segment_kernels("tiles", s["x"].shape[1])
    if path != planner.MIXED:
        return None, None
    plan = mixed._plan(s["x"].device, M, L, s["offsets"], s["a"].shape[2],
                       s["x"].shape[1], None)

    def shrink_mixed(s):
        return mixed.lora_shrink_mixed(s["x"], s["a"], s["meta"], plan, s["ranks"])

    def expand_mixed(s, h):
        return mixed.lora_expand_mixed(h, s["b"], s["y"], s["meta"], plan, s["ranks"])
    return shrink_mixed, expand_mixed


def write(results: list[Result], bw: float, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    fields = list(Result.__dataclass_fields__)
    with open(out / "kernels.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in results:
            w.writerow(asdict(r))
    lines = [f"Measured copy bandwidth: {bw / 1e9:.0f} GB/s (read + write)", "",
             "| " + " | ".join(fields) + " |", "|" + "---|" * len(fields)]
    for r in results:
        lines.append("| " + " | ".join(_fmt(v) for v in asdict(r).values()) + " |")
    (out / "kernels.md").write_text("\n".join(lines) + "\n")


def _part(us: float, pct: float) -> str:
    """' 123.4us (56%)' for a kernel timed alone, blank where it was not."""
    return "" if us != us else f" {us:7.1f}us ({pct:3.0f}%)"


def _fmt(v) -> str:
    return f"{v:.1f}" if isinstance(v, float) else str(v)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--planner" in argv:   # every form on every cell of the planner's table
        from benchmarks.plan_grid import main as planner
        return planner([a for a in argv if a != "--planner"])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--quick", action="store_true", help="a small subset of the grid")
    p.add_argument("--targets", action="store_true",
                   help="the target points only: all groups, rank 16, T 1/16/64/128/256/8192, "
                        "L 1/64")
    p.add_argument("--uniform", action="store_true",
                   help="one adapter, T 1/16/64 (with --quick: qkv and down, T 1/64), rank 16: "
                        "the two-launch path, also timed after the group's base matmul")
    p.add_argument("--prefill", action="store_true",
                   help="T 8192 over 64 adapters (with --quick: qkv and down), rank 16: the "
                        "tile-list prefill path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU", file=sys.stderr)
        return 2
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    results = []
    print(f"{'group':8} {'r':>4} {'T':>5} {'L':>4} {'map':10} {'path':10} {'n':>2} {'us':>9} "
          f"{'floor':>8} {'GB/s':>7} {'%floor':>7} {'shrink':>14} {'expand':>14}")
    for case in cases(args.quick, args.targets, args.uniform, args.prefill):
        r = run_case(case, bw, gemm=args.uniform and case.adapters == 1)
        results.append(r)
        gemm = ("" if r.gemm_us != r.gemm_us else
                f" | matmul {r.gemm_us:7.1f}us, +LoRA {r.with_gemm_us:7.1f}us "
                f"(LoRA adds {r.with_gemm_us - r.gemm_us:5.1f}us)")
        print(f"{r.group:8} {r.rank:4} {r.tokens:5} {r.adapters:4} {r.mapping:10} {r.path:10} "
              f"{r.launches:2} {r.us:9.1f} {r.floor_us:8.1f} {r.gbps:7.0f} {r.pct_floor:6.1f}%"
              f"{_part(r.shrink_us, r.shrink_pct)}{_part(r.expand_us, r.expand_pct)}{gemm}",
              flush=True)
        torch.cuda.empty_cache()
    write(results, bw, args.out)
    print(f"wrote {args.out / 'kernels.csv'} and {args.out / 'kernels.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
