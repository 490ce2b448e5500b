"""Our LoRA kernels beside vLLM's and SGLang's Triton LoRA kernels, same shapes, same run:

    python -m benchmarks.kernels peers --out DIR [--tiny] [--ranks 16,64] [--ours-only]

Per case (a Llama-3-8B projection group, rank, tokens, adapters): ours (kernels/lora/
launch.py add_lora on the path kernels/lora/plan.py chooses, with the engine's hints),
vLLM's lora_shrink + lora_expand and SGLang's chunked SGMV shrink + expand
(benchmarks/peer_calls.py), each checked against the torch reference on random A and B
before it is timed (one that disagrees is reported, not timed), timed in CUDA graphs over
rotating buffer sets; the floor is the two launches' bytes over the copy bandwidth
measured in the same run (bench_kernels.py). Writes DIR/peers.json; the table last.

The peers' sources come from their wheels, fetched apart (benchmarks/peer_sources.py) into
benchmarks/.peers/ (--peers-dir). Without them the case says how to fetch them and stops,
unless --ours-only; --tiny (the CPU, Triton's interpreter, tiny shapes: a check of the
script, not a measurement) runs what it has and marks the rest skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.bench_kernels import (expand_floor_bytes, layer_groups,  # noqa: E402
                                      shrink_floor_bytes, token_slots_for)
from benchmarks.peer_report import cell, medians, summarize, summary_lines, table  # noqa: E402
from benchmarks.peer_sources import DEFAULT_DIR, PEERS, PeerMissing, fetch_hint, find  # noqa: E402

DECODE_TOKENS = (1, 16, 64, 256)
PREFILL = ((2048, 1), (2048, 8))          # (tokens, adapters)
TINY_GROUPS = [("qkv", 64, (64, 16, 16)), ("o", 64, (64,)), ("gate_up", 64, (96, 96)),
               ("down", 96, (64,))]
TINY_DECODE, TINY_PREFILL, TINY_RANKS = (1, 5), ((272, 1), (272, 3)), (8,)
SGLANG_CHUNKS = (16, 128)  # --max-lora-chunk-size values tried: its default and its largest


@dataclass(frozen=True)
class Case:
    group: str
    K: int
    N: tuple[int, ...]
    rank: int
    tokens: int
    adapters: int
    mapping: str       # "contiguous" (runs by adapter) or "random"


def cases(tiny: bool, ranks: tuple[int, ...], groups: tuple[str, ...] | None) -> list[Case]:
    """Decode sizes with one adapter and with every token its own adapter (random order),
    prefill sizes over a few adapters (in runs, as requests arrive)."""
    shapes = TINY_GROUPS if tiny else layer_groups()
    decode, prefill = (TINY_DECODE, TINY_PREFILL) if tiny else (DECODE_TOKENS, PREFILL)
    out = []
    for g, K, N in shapes:
        if groups and g not in groups:
            continue
        for r in ranks:
            for t in decode:
                out.append(Case(g, K, N, r, t, 1, "contiguous"))
                if t > 1:
                    out.append(Case(g, K, N, r, t, t, "random"))
            out += [Case(g, K, N, r, t, n, "contiguous") for t, n in prefill]
    return out


def dtype_for(device: torch.device) -> torch.dtype:
    """bf16, the engine's; float16 in Triton's interpreter, whose tl.dot multiplies bf16
    tiles as their raw 16-bit patterns (Triton 3.9: the peers' kernels, which feed bf16
    straight to tl.dot, return numbers of 1e10 there). Both peers take float16 too."""
    return torch.bfloat16 if device.type == "cuda" else torch.float16


def make_set(case: Case, seed: int, device: torch.device) -> dict:
    """Random activations and output, an L-slot pool of random A and B (never zero)."""
    from loramux_kernels.lora.launch import build_meta
    g = torch.Generator(device=device).manual_seed(seed)
    dt = dtype_for(device)
    L, S, r, T, K = case.adapters, len(case.N), case.rank, case.tokens, case.K
    kw = dict(device=device, generator=g)
    slots = token_slots_for(T, L, case.mapping, "cpu")
    if case.mapping == "random":   # the same multiset, shuffled by this set's generator
        slots = slots[torch.randperm(T, generator=torch.Generator().manual_seed(seed))]
    slots = slots.to(device)
    return dict(x=torch.randn(T, K, **kw).to(dt),
                y=torch.randn(T, sum(case.N), **kw).to(dt),
                a=(torch.randn(L, S, r, K, **kw) / K ** 0.5).to(dt),
                b=(torch.randn(L, sum(case.N), r, **kw) / r ** 0.5).to(dt),
                slots=slots, offsets=tuple(int(v) for v in torch.tensor((0,) + case.N).cumsum(0)),
                ranks=torch.full((L,), r, dtype=torch.int32, device=device),
                meta=build_meta(slots, L))


def agrees(make_call, s: dict, rows: int = 64) -> tuple[bool, float]:
    """(close, largest error): the call on a copy of s against the torch reference on up
    to 2·rows sampled rows (every row on the CPU); tokens are independent."""
    from loramux_kernels.lora.reference import add_lora_ref
    got = dict(s, y=s["y"].clone())
    make_call(got)()
    T = s["x"].shape[0]
    pick = (torch.arange(T) if s["x"].device.type == "cpu" else torch.unique(torch.cat(
        [torch.arange(min(T, rows)), torch.randperm(T)[:rows]])))
    pick = pick.to(s["x"].device)
    want = add_lora_ref(s["y"][pick].clone(), s["x"][pick], s["a"], s["b"], s["slots"][pick],
                        s["offsets"]).float()
    have = got["y"][pick].float()
    err = float((have - want).abs().max())
    return bool(torch.allclose(have, want, atol=6e-2, rtol=3e-2)), err


def time_calls(calls: list, device: torch.device) -> float:
    """Median seconds per call: CUDA graphs over the rotating sets' calls; on the CPU (the
    interpreter) one warm call each, a check of the flow only."""
    if device.type == "cuda":
        from benchmarks.common import time_graph
        return time_graph(calls)
    times = []
    for fn in calls:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Copy bandwidth (bytes read + written per s) of the device measured now."""
    if device.type == "cuda":
        from benchmarks.common import copy_bandwidth as cuda_bandwidth
        return cuda_bandwidth()
    src = torch.randn(1 << 23)
    dst = torch.empty_like(src)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def implementations(args) -> tuple[dict, dict]:
    """({name: make_call(set, chunk) or None}, {name: status}) for ours and each peer: a
    peer is loaded from its fetched files, else skipped with the reason. `chunk` is read
    by SGLang's alone (its segment rows)."""
    from benchmarks import peer_calls
    from benchmarks.peer_shims import load
    makers = {"ours": lambda s, chunk: peer_calls.ours_call(s)}
    status = {"ours": "ok"}
    for name, spec in PEERS.items():
        makers[name] = None
        try:
            manifest = find(spec, args.peers_dir)
            mods = load(spec, args.peers_dir / spec.folder)
        except PeerMissing as e:
            status[name] = f"skipped: {e}"
            continue
        except Exception as e:  # noqa: BLE001 - their code, any failure: reported, not ours
            status[name] = f"load failed: {type(e).__name__}: {e}"
            continue
        status[name] = f"ok ({manifest['wheel']}, sha256 {manifest['sha256'][:12]})"
        makers[name] = (
            (lambda s, chunk, m=mods: peer_calls.vllm_call(m, s)) if name == "vllm" else
            (lambda s, chunk, m=mods: peer_calls.sglang_call(m, s, chunk)))
    return makers, status


def chunks(name: str, tokens: int, max_chunks: tuple[int, ...]) -> list[int]:
    """The distinct SGLang chunk sizes its rule gives `tokens` under each
    --max-lora-chunk-size tried; [0] (unused) for the others."""
    from benchmarks.peer_calls import sglang_chunk
    if name != "sglang":
        return [0]
    return sorted({sglang_chunk(tokens, m) for m in max_chunks})


def run_case(case: Case, makers: dict, bw: float, device: torch.device,
             max_chunks: tuple[int, ...]) -> dict:
    """One row: the floor, and per implementation its time (us) or why it has none."""
    from benchmarks.common import floor_seconds, rotating_sets
    from benchmarks.peer_calls import ours_path
    L, S, r, T, K, N = case.adapters, len(case.N), case.rank, case.tokens, case.K, case.N
    per_set = 2 * (T * K + L * S * r * K + L * sum(N) * r + T * sum(N))
    sets = [make_set(case, seed, device)
            for seed in range(rotating_sets(per_set) if device.type == "cuda" else 1)]
    nbytes = shrink_floor_bytes(T, K, S, r, L) + expand_floor_bytes(T, N, r, L)
    row = dict(asdict(case), N=list(N), path=ours_path(sets[0]),
               floor_us=floor_seconds(nbytes, bw, 2) * 1e6, results={})
    for name, make in makers.items():
        if make is None:
            continue
        best = None
        for chunk in chunks(name, T, max_chunks):
            try:
                ok, err = agrees(lambda s: make(s, chunk), sets[0])
                if not ok:
                    best = best or dict(status=f"disagrees with the reference (max error "
                                               f"{err:.3g})")
                    continue
                us = time_calls([make(s, chunk) for s in sets], device) * 1e6
            except Exception as e:  # noqa: BLE001 - a failing peer kernel is a result
                if name == "ours":
                    raise
                best = best or dict(status=f"failed: {type(e).__name__}: {str(e)[:200]}")
                continue
            if best is None or "us" not in best or us < best["us"]:
                best = dict(status="ok", us=us, max_error=err,
                            **({"chunk": chunk} if name == "sglang" else {}))
        row["results"][name] = best
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(v) for v in text.split(",") if v)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tiny", action="store_true",
                   help="the CPU under Triton's interpreter, tiny shapes (checks the script)")
    p.add_argument("--ranks", type=_ints, default=None, help="default 16,64 (tiny: 8)")
    p.add_argument("--groups", type=lambda t: tuple(t.split(",")), default=None,
                   help="projection groups, e.g. qkv,down (default: all four)")
    p.add_argument("--peers-dir", type=Path, default=DEFAULT_DIR,
                   help="where benchmarks/peer_sources.py extracted the peers")
    p.add_argument("--ours-only", action="store_true",
                   help="run without the peers' sources (else their absence stops the run)")
    p.add_argument("--sglang-chunks", type=_ints, default=SGLANG_CHUNKS,
                   help="SGLang --max-lora-chunk-size values to try, best kept "
                        "(default 16,128: its default and its largest)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.tiny:   # before any kernel module is imported: Triton decides at decoration
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("bench_peers measures on a CUDA GPU; --tiny checks it on the CPU", file=sys.stderr)
        return 2
    device = torch.device("cpu" if args.tiny else "cuda")
    missing = [str(e) for e in _missing(args.peers_dir)]
    if missing and not (args.tiny or args.ours_only):
        print("bench_peers: the peers' sources are not here:\n  " + "\n  ".join(missing)
              + f"\n  {fetch_hint(args.peers_dir)}\n  (or --ours-only)", file=sys.stderr)
        return 2
    makers, status = implementations(args)
    for name, line in status.items():
        print(f"{name}: {line}", flush=True)
    bw = copy_bandwidth(device)
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s on {_device_name(device)}", flush=True)
    ranks = args.ranks or (TINY_RANKS if args.tiny else (16, 64))
    rows = []
    for case in cases(args.tiny, ranks, args.groups):
        row = summarize(run_case(case, makers, bw, device, args.sglang_chunks))
        rows.append(row)
        print(f"{case.group:8} r={case.rank:<3} T={case.tokens:<5} L={case.adapters:<4} "
              + "  ".join(f"{n}={cell(row['results'].get(n), n)}" for n in makers),
              flush=True)
    peers = [n for n in makers if n != "ours"]
    result = dict(device=_device_name(device), interpreter=args.tiny, copy_bandwidth=bw,
                  implementations=status, medians=medians(rows), rows=rows)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "peers.json").write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out / 'peers.json'}\n")
    note = (["Triton's interpreter on the CPU, float16: the times check the flow, they "
             "measure nothing"] if args.tiny else [])
    print("\n".join([*note, *summary_lines(result["medians"]), "",
                     *table(rows, peers, status)]))
    return 0


def _missing(root: Path) -> list[PeerMissing]:
    out = []
    for spec in PEERS.values():
        try:
            find(spec, root)
        except PeerMissing as e:
            out.append(e)
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu (Triton interpreter)"


if __name__ == "__main__":
    sys.exit(main())
