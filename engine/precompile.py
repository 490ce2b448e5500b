"""Parallel kernel compilation before the warm-up, on a fresh machine.

The warm-up (engine/warmup.py) launches every kernel variant a configuration can reach,
one after the other: on a fresh machine each launch of a new variant compiles it in this
one process, on one core (an H200 host has 16). So first a dry run of the same warm-up
lists the variants without compiling or launching any (Triton's jit_cache_hook sees
each variant's specialization and says "skip"), and N worker processes
(`python -m loramux_engine.precompile -`, no model, one CUDA context each), started before it,
compile each variant (JITFunction.preload) into the shared Triton cache
($TRITON_CACHE_DIR) as soon as the dry run finds it, dealt out in turn: the workers'
start and most of their compiling happen while the listing still runs. Then the real
warm-up finds every variant on disk. The graphs the dry run captured
launched nothing and are dropped.

A finished precompile marks the cache with a fingerprint of the engine's resolved
configuration, the source of engine/ and kernels/, torch, triton and the GPU, and keeps
in the mark the eager shapes that first launched some variant in the dry run
(engine/warmup.py CoveringShapes); a start that finds the mark goes straight to the
warm-up, which then runs only those shapes (the one after a dry run too). Nothing
depends on the workers for correctness: a variant they missed or failed is compiled by
the warm-up itself."""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MAX_WORKERS = 8
_PACKAGES = ("loramux_engine", "loramux_kernels")


@dataclasses.dataclass(frozen=True)
class PrecompileReport:
    workers: int
    variants: int
    seconds: float
    list_seconds: float = 0.0   # the dry run that listed the variants
    skipped: str = ""           # why nothing ran ("" when it did)
    failed: int = 0             # variants a worker could not compile (the warm-up will)
    shapes: tuple | None = None  # the eager shapes that cover every variant (None: unknown)

    def __str__(self) -> str:
        cover = ("" if self.shapes is None else
                 f"; {len(self.shapes)} eager shapes cover them all")
        if self.skipped:
            return f"parallel compile skipped ({self.skipped}){cover}"
        return (f"parallel compile: {self.variants} kernel variants listed in "
                f"{self.list_seconds:.1f} s, compiled by {self.workers} processes; "
                f"{self.seconds:.1f} s in all" + (f", {self.failed} failed" if self.failed else "")
                + cover)


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
    for package in _PACKAGES:
        folder = Path(importlib.import_module(package).__file__).parent
        for path in sorted(folder.rglob("*.py")):
            h.update(path.read_bytes())
    return h.hexdigest()[:32]


def cache_dir() -> Path:
    """Triton's cache directory ($TRITON_CACHE_DIR, else Triton's default)."""
    if os.environ.get("TRITON_CACHE_DIR"):
        return Path(os.environ["TRITON_CACHE_DIR"])
    from triton.runtime.cache import default_cache_dir

    return Path(default_cache_dir())


def list_variants(run, found=None) -> list[tuple[str, str, str]]:
    """(module, function name, Triton specialization data) of every kernel variant
    `run()` would compile, in launch order; nothing is compiled or launched meanwhile.
    `found(variant)`, if given, is called with each new one as it is found.

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
        variant = (fn.module, fn.name, compile["specialization_data"])
        if variant not in seen:
            seen[variant] = None
            if found is not None:
                found(variant)
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
    processes (None: default_workers); None where there is nothing to do (the CPU).
    Under tensor parallelism rank 0 lists alone (its collectives skipped: every rank's
    shard has its shapes, so its variants), and every rank's warm-up then loads them."""
    from loramux_engine.resolve import MachineFacts

    if engine.device.type != "cuda":
        return None
    count = default_workers(MachineFacts.probe("cpu").cpu_count) if workers is None else workers
    if count <= 0:
        return PrecompileReport(0, 0, 0.0, skipped="no workers")
    start = time.perf_counter()
    marker = cache_dir() / f"loramux-precompiled-{fingerprint(engine.config)}"
    if marker.exists():
        return PrecompileReport(0, 0, 0.0, skipped="the compile cache is warm",
                                shapes=read_mark(marker))
    from loramux_engine.warmup import CoveringShapes   # here: the workers never import the model

    if progress is not None:
        progress.advance(f"listing kernel variants, compiling them in {count} processes", 0.0)
    covering = CoveringShapes()

    def found(variant) -> None:
        workers.send(variant)
        covering.found()

    with tempfile.TemporaryDirectory(prefix="loramux-precompile-") as tmp:
        workers = _Workers(count, Path(tmp))
        try:
            variants = list_variants(lambda: engine.warm_up(on_shape=covering.at,
                                                            this_rank=True), found=found)
        finally:
            listed = time.perf_counter() - start
            failed = workers.finish(progress, time.monotonic() + timeout_s)
    if engine.runner.graphs is not None:
        engine.runner.graphs.release()   # captured without their kernels: useless
    shapes = tuple(covering.shapes)
    if not failed:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"variants": len(variants),
                                      "shapes": [dataclasses.astuple(s) for s in shapes]}))
    return PrecompileReport(count, len(variants), time.perf_counter() - start, listed,
                            failed=failed, shapes=shapes)


def read_mark(marker: Path) -> tuple | None:
    """The covering eager shapes a cache mark keeps; None where it keeps none (a mark of
    an older version, or unreadable: the warm-up then runs every shape)."""
    from loramux_engine.warmup import EagerShape

    try:
        return tuple(EagerShape(*row) for row in json.loads(marker.read_text())["shapes"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _Workers:
    """Compile worker processes fed variants over their stdin, one JSON line each, dealt
    out in turn as the dry run finds them (a thread per worker writes, so a slow worker
    never blocks the listing); each prints how many it could not compile when its input
    ends. Their output goes to files: a worker that says much never stalls on a pipe."""

    def __init__(self, count: int, tmp: Path):
        self.procs, self._queues, self._threads, self._logs = [], [], [], []
        self.sent = 0
        for i in range(count):
            out, err = open(tmp / f"out-{i}", "w+"), open(tmp / f"err-{i}", "w+")
            self._logs.append((out, err))
            proc = subprocess.Popen([sys.executable, "-m", "loramux_engine.precompile", "-"],
                                    stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    text=True)
            q: queue.Queue = queue.Queue()
            thread = threading.Thread(target=self._feed, args=(proc, q), daemon=True,
                                      name=f"precompile-feed-{i}")
            thread.start()
            self.procs.append(proc)
            self._queues.append(q)
            self._threads.append(thread)

    @staticmethod
    def _feed(proc, q: queue.Queue) -> None:
        try:
            while (variant := q.get()) is not None:
                proc.stdin.write(json.dumps(variant) + "\n")
                proc.stdin.flush()
        except OSError:   # the worker died: finish() reports its exit status
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    def send(self, variant) -> None:
        self._queues[self.sent % len(self._queues)].put(variant)
        self.sent += 1

    def finish(self, progress, deadline: float) -> int:
        """End the input, wait for every worker (killed at `deadline`); how many variants
        failed (a worker that exited badly: every variant it was sent)."""
        for q in self._queues:
            q.put(None)
        failed, n = 0, len(self.procs)
        for done, (proc, thread, (out, err)) in enumerate(
                zip(self.procs, self._threads, self._logs), 1):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            thread.join(timeout=10)
            out.seek(0)
            err.seek(0)
            said = out.read().strip()
            if proc.returncode != 0 or not said.isdigit():
                tail = err.read().strip().splitlines()[-2:]
                print(f"engine precompile worker exited {proc.returncode}: {' | '.join(tail)}",
                      file=sys.stderr, flush=True)
                failed += len(range(done - 1, self.sent, n))
            else:
                failed += int(said)
            out.close()
            err.close()
            if progress is not None:
                progress.advance(f"compiling {self.sent} kernel variants in {n} "
                                 f"processes, {done}/{n} done", done / n)
        return failed


def _jit_function(module: str, name: str):
    """The JITFunction `name` of `module`, unwrapped from autotuners and heuristics."""
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    while not hasattr(obj, "preload") and hasattr(obj, "fn"):
        obj = obj.fn
    return obj


def compile_share(variants) -> int:
    """Compile each (module, name, specialization data) into the Triton cache, with the
    host-side launcher Triton builds for it at its first launch (a C module per argument
    signature, cached beside the kernels; left to the warm-up, they are the likely
    reason it still counted 19 of 90 variants as compiled on an H200); how many failed
    (each said on stderr)."""
    failed = 0
    for module, name, spec in variants:
        try:
            kernel = _jit_function(module, name).preload(spec)
            if hasattr(kernel, "_init_handles"):
                kernel._init_handles()   # builds the launcher; loads the kernel here too
        except Exception as err:  # the warm-up compiles it instead
            failed += 1
            print(f"{module}.{name}: {err!r}", file=sys.stderr, flush=True)
    return failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m loramux_engine.precompile",
                                description="One compile worker of an engine's start.")
    p.add_argument("input", choices=["-"],
                   help="- : [module, function, specialization data] as JSON, one a line "
                        "on stdin, compiled as they come until it ends")
    p.parse_args(argv)
    print(compile_share(json.loads(line) for line in sys.stdin if line.strip()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
