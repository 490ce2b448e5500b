"""Parallel kernel compilation before the warm-up, on a fresh machine.

The warm-up (engine/warmup.py) launches every kernel variant a configuration can reach,
one after the other: on a fresh machine each launch of a new variant compiles it in this
one process, on one core (an H200 host has 16). So first a dry run of the same warm-up
lists the variants without compiling or launching any (Triton's jit_cache_hook sees
each variant's specialization and says "skip"); then N worker processes
(`python -m engine.precompile`, no model, one CUDA context each) compile a share of
the list each (JITFunction.preload) into the shared Triton cache ($TRITON_CACHE_DIR);
then the real warm-up finds every variant on disk. The graphs the dry run captured
launched nothing and are dropped.

A finished precompile marks the cache with a fingerprint of the engine's resolved
configuration, the source of engine/ and kernels/, torch, triton and the GPU; a start
that finds the mark goes straight to the warm-up. Nothing depends on the workers for
correctness: a variant they missed or failed is compiled by the warm-up itself."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MAX_WORKERS = 8
_PACKAGES = ("engine", "kernels")


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    workers: int
    variants: int
    seconds: float
    list_seconds: float = 0.0   # the dry run that listed the variants
    skipped: str = ""           # why nothing ran ("" when it did)
    failed: int = 0             # variants a worker could not compile (the warm-up will)

    def __str__(self) -> str:
        if self.skipped:
            return f"parallel compile skipped ({self.skipped})"
        return (f"parallel compile: {self.variants} kernel variants listed in "
                f"{self.list_seconds:.1f} s, compiled by {self.workers} processes; "
                f"{self.seconds:.1f} s in all" + (f", {self.failed} failed" if self.failed else ""))


def default_workers(cpu_count: int) -> int:
    """Half the cores (the other half keeps the machine responsive), at most 8."""
    return max(0, min(MAX_WORKERS, cpu_count // 2))


# Settings that launch no other kernel variant: sizes taken from the memory free at start
# (they differ by a few units from one start to the next, which made every restart of a
# replica list and compile again) and host-side work. Were one of them to matter after
# all, the warm-up compiles what is missing itself; the mark only skips the parallel step.
UNRELATED = frozenset({"model", "max_cpu_loras", "num_kv_blocks", "gpu_memory_utilization",
                       "cpu_threads", "seed", "load_format", "adapter_roots",
                       "adapter_loaders", "host_reserve_loras"})


def fingerprint(config) -> str:
    """What decides the variants a warm-up compiles: the resolved engine configuration
    (the model's directory aside: its config.json is hashed instead), the engine's and
    kernels' source, torch, triton and the GPU."""
    import torch
    import triton

    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in UNRELATED}
    h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    model_config = Path(config.model) / "config.json"
    if model_config.exists():
        h.update(model_config.read_bytes())
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    h.update(f"{torch.__version__} {triton.__version__} {gpu}".encode())
    root = Path(__file__).resolve().parents[1]
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(path.read_bytes())
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    """Triton's cache directory ($TRITON_CACHE_DIR, else Triton's default)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    from triton.runtime.cache import default_cache_dir

    return Path(default_cache_dir())


def list_variants(run) -> list[tuple[str, str, str]]:
    """(module, function name, Triton specialization data) of every kernel variant
    `run()` would compile, in launch order; nothing is compiled or launched meanwhile.

    Triton asks its jit_cache_hook before each compile, and a "skip" leaves the variant
    uncompiled, so every later launch of it asks again and pays for serializing its
    specialization each time (a warm-up launches each variant thousands of times). So
    the compile step itself is wrapped for the duration: a variant seen before returns
    at the cost of a dict look-up."""
    from triton import knobs
    from triton.runtime.jit import JITFunction

    seen: dict[tuple[str, str, str], None] = {}
    known: set[tuple[int, object]] = set()

    def skip(*, fn, compile, **_):
        seen.setdefault((fn.module, fn.name, compile["specialization_data"]), None)
        return True

    do_compile = JITFunction._do_compile

    def listed_once(self, key, *args, **kwargs):
        if (id(self), key) in known:
            return None
        known.add((id(self), key))
        return do_compile(self, key, *args, **kwargs)

    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = skip
    JITFunction._do_compile = listed_once
    try:
        run()
    finally:
        JITFunction._do_compile = do_compile
        knobs.runtime.jit_cache_hook = before
    return list(seen)


def precompile(engine, workers: int | None, progress=None,
               timeout_s: float = 900.0) -> PrecompileReport | None:
    """List the variants `engine`'s warm-up launches and compile them in `workers`
    processes (None: default_workers); None where there is nothing to do (the CPU;
    tensor parallelism, whose warm-up does not run yet)."""
    from engine.resolve import MachineFacts

    if engine.device.type != "cuda" or engine.config.tp_size > 1:
        return None
    count = default_workers(MachineFacts.probe("cpu").cpu_count) if workers is None else workers
    if count <= 0:
        return PrecompileReport(0, 0, 0.0, skipped="no workers")
    start = time.perf_counter()
    marker = cache_dir() / f"loramux-precompiled-{fingerprint(engine.config)}"
    if marker.exists():
        return PrecompileReport(0, 0, 0.0, skipped="the compile cache is warm")
    if progress is not None:
        progress.advance("listing kernel variants", 0.0)
    variants = list_variants(lambda: engine.warm_up())
    if engine.runner.graphs is not None:
        engine.runner.graphs.release()   # captured without their kernels: useless
    listed = time.perf_counter() - start
    failed = _compile(variants, count, progress, time.monotonic() + timeout_s)
    if not failed:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(f"{len(variants)} variants\n")
    return PrecompileReport(count, len(variants), time.perf_counter() - start, listed,
                            failed=failed)


def _compile(variants, workers: int, progress, deadline: float) -> int:
    """Compile `variants` in `workers` processes; how many failed."""
    with tempfile.TemporaryDirectory(prefix="loramux-precompile-") as tmp:
        procs = []
        for i in range(workers):
            share = Path(tmp) / f"share-{i}.json"
            share.write_text(json.dumps(variants[i::workers]))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "engine.precompile", str(share)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_worker_env()))
        failed = 0
        for done, proc in enumerate(procs, 1):
            try:
                out, err = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            if proc.returncode != 0:
                tail = err.decode(errors="replace").strip().splitlines()[-2:]
                print(f"engine precompile worker exited {proc.returncode}: {' | '.join(tail)}",
                      file=sys.stderr, flush=True)
                failed += len(variants[done - 1::workers])
            else:
                failed += int(out.decode().strip() or 0)
            if progress is not None:
                progress.advance(f"compiling {len(variants)} kernel variants in {workers} "
                                 f"processes, {done}/{workers} done", done / workers)
    return failed


def _worker_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _jit_function(module: str, name: str):
    """The JITFunction `name` of `module`, unwrapped from autotuners and heuristics."""
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "preload") and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def compile_share(variants) -> int:
    """Compile each (module, name, specialization data) into the Triton cache; how many
    failed (each said on stderr)."""
    failed = 0
    for module, name, spec in variants:
        try:
            _jit_function(module, name).preload(spec)
        except Exception as err:  # the warm-up compiles it instead
            failed += 1
            print(f"{module}.{name}: {err!r}", file=sys.stderr, flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.precompile",
                                description="One compile worker of an engine's start.")
    p.add_argument("share", help="JSON list of [module, function, specialization data]")
    a = p.parse_args(argv)
    print(compile_share(json.loads(Path(a.share).read_text())), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
