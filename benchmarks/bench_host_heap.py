"""What CPython's full collection walks per host copy the engine keeps: N host copies of a
Llama-3-8B-layout adapter (32 layers, rank 16, all seven projections, 128 wide: the count
of objects does not depend on the widths, so N fit in any memory), their gc-tracked
objects and the time of a full collection (`gc.collect(2)`, median of 5), with each
(layer, group)'s GroupWeights kept (the layout before LayerGroups) and made when asked for
(engine/lora/weights.py LayerGroups), side by side in one run. A full collection runs on
the engine's step thread: the next step waits for it.

    python -m benchmarks.adapters heap --out DIR [--copies 800]

The serve defaults keep 798 host copies on an H100 (BENCHMARKS.md, start-up and defaults).
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from types import MappingProxyType


def _full_collection_s() -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        gc.collect(2)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    from loramux_core.model.hf_config import ModelConfig
    from loramux_engine.lora.weights import load_lora
    from loramux_services.demo_model import DemoSpec, write_adapter, write_model

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--copies", type=int, default=800)
    args = p.parse_args(argv)
    spec = DemoSpec(num_layers=32, lora_rank=16)
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp) / "model", spec)
        write_adapter(Path(tmp) / "adapter", spec, seed=1)
        mc = ModelConfig.from_dir(Path(tmp) / "model")
        one = load_lora(Path(tmp) / "adapter", mc, spec.lora_rank)
    rows = {}
    for layout in ("per layer (before)", "on demand (LayerGroups)"):
        gc.collect()
        gc.freeze()  # as the engine does after start-up: only what comes after is walked
        base = len(gc.get_objects())
        copies = [_copy(one, layout.startswith("per layer")) for _ in range(args.copies)]
        gc.collect()
        tracked = len(gc.get_objects()) - base
        rows[layout] = {"tracked_per_copy": tracked / args.copies,
                        "full_collection_ms": _full_collection_s() * 1e3}
        del copies
        gc.unfreeze()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host-heap.json").write_text(json.dumps({"copies": args.copies, "rows": rows},
                                                   indent=2))
    print(f"{args.copies} host copies (32 layers, 7 projections)")
    print("| groups | tracked objects per copy | full collection ms |\n|---|---|---|")
    for layout, r in rows.items():
        print(f"| {layout} | {r['tracked_per_copy']:.0f} | {r['full_collection_ms']:.1f} |")
    return 0


def _copy(weights, per_layer: bool):
    """Another host copy's Python objects over the same bytes: the views and mappings a
    load makes, with the groups laid out as asked."""
    from loramux_engine.lora.weights import LayerGroups

    stacked = MappingProxyType({g: (a[:], b[:]) for g, (a, b) in weights.stacked.items()})
    groups = LayerGroups(stacked, {k: g.slice_ranks for k, g in weights.groups.items()})
    if per_layer:
        groups = MappingProxyType({k: groups[k] for k in groups})
    return dataclasses.replace(weights, stacked=stacked, groups=groups)


if __name__ == "__main__":
    raise SystemExit(main())
