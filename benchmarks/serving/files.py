"""The model and adapter directories a serving benchmark runs on.

Synthetic: a Llama-3-8B-shaped model directory without weights (the engine runs it with
random weights, `--load-format dummy`) and a few distinct rank-16 adapters with random
weights (benchmarks/llama8b.py). Tiny: the demo model and its adapters (real files, CPU).
Either way the N adapter directories the service registers are hard links of those few
distinct weight sets, so 2,000 adapters cost no more disk than 4; each is still read,
validated, hashed and placed on its own."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Files:
    model: Path
    adapter_root: Path
    names: tuple[str, ...]       # every adapter name, "a0000" ..., in registration order
    vocab: range                 # token ids prompts are drawn from (no special ids)
    dummy_weights: bool          # the engine must run with --load-format dummy
    adapter_bytes: int           # one adapter's weights file (mean over the weight sets)


def _vocab(model: Path) -> range:
    """Ids 3 .. below the first special id past the small ones (Llama 3's specials start
    at 128000; the tiny models' are 0-2)."""
    cfg = json.loads((model / "config.json").read_text())
    ids = [cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")]
    high = [i for i in ids if isinstance(i, int) and i > 16]
    return range(3, min([cfg["vocab_size"], *high]))


def model_dir(work: Path, tiny: bool, layers: int | None) -> tuple[Path, bool]:
    """(the model dir, whether its weights are dummy): quick to make (the 8B shape has no
    weight files), so the service can start before the adapters' files are written."""
    if tiny:
        from loramux_services.demo_model import ensure_demo

        return ensure_demo(work / "demo"), False
    from benchmarks.llama8b import write_model_dir

    model = work / "model"
    if not (model / "config.json").exists():
        write_model_dir(model, num_layers=layers)
    return model, True


def distinct_weights(work: Path, tiny: bool, layers: int | None, rank: int,
                     distinct: int) -> tuple[Path, list[Path], bool]:
    """(model dir, the distinct adapter dirs, whether the weights are dummy)."""
    model, dummy = model_dir(work, tiny, layers)
    if tiny:
        from loramux_services.demo_model import DEMO_ADAPTERS

        return model, [model / "adapters" / n for n in DEMO_ADAPTERS][:max(1, distinct)], dummy
    from benchmarks.llama8b import write_adapter

    weights = []
    for k in range(distinct):
        path = work / "weights" / f"w{k}"
        if not (path / "adapter_config.json").exists():
            write_adapter(path, model, rank=rank, seed=k)
        weights.append(path)
    return model, weights, dummy


def link_adapters(root: Path, weights: list[Path], n: int) -> tuple[str, ...]:
    """Adapter dirs root/a0000 .. root/a{n-1}: hard links of weights[i % len(weights)]."""
    names = tuple(f"a{i:04d}" for i in range(n))
    for i, name in enumerate(names):
        src, dst = weights[i % len(weights)], root / name
        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and not (dst / f.name).exists():
                os.link(f, dst / f.name)
    return names


def adapter_root(work: Path) -> Path:
    """Where prepare() puts the adapter dirs (made here: a service can start on it first)."""
    root = work / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    return root


def prepare(work: Path, *, tiny: bool, num_adapters: int, distinct: int, layers: int | None,
            rank: int = 16) -> Files:
    model, weights, dummy = distinct_weights(work, tiny, layers, rank, distinct)
    root = adapter_root(work)
    names = link_adapters(root, weights, num_adapters)
    size = sum((w / "adapter_model.safetensors").stat().st_size for w in weights) // len(weights)
    return Files(model, root, names, _vocab(model), dummy, size)
