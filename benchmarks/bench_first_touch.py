"""What fresh host memory costs a decoding engine. Loads into host memory the engine already
holds ran at 109.7/s with the decode step unchanged on an H200, loads into fresh memory at
34.9/s with the step 1.5x (benchmarks/results/2026-11-28-h200-loads2/NOTES.md); this
measures the two things a fresh host copy adds, apart, with the engine's own primitives:

- populate: the pages of fresh shared buffers (engine/lora/shared_memory.py, one memfd
  segment per size, as the host cache cuts them) faulted in by MADV_POPULATE_WRITE
  (engine/lora/host_buffers.py `populate`, what the engine's pin thread and the loaders'
  MAP_POPULATE do), on 1 and on several threads at once: GB/s in all;
- register: populated buffers page-locked by cudaHostRegister on one thread, as the
  engine's pin thread does (CUDA only).

Meanwhile a probe thread stands in for the step thread: on the CPU it sleeps 1 ms at a
time and counts the oversleep; on CUDA it launches a small kernel and synchronizes every
1 ms and counts how long that took. Each row gives the probe's median, p99 and max (ms)
during the work, against a window with no work first. A probe stretched by populate on
several threads, with GB/s that do not grow with threads, says the machine serializes
first touches (a VM's memory backing); one stretched only by register says the driver's
lock.

    python -m benchmarks.adapters first-touch --out DIR             # 48 buffers of 84 MB
    python -m benchmarks.adapters first-touch --out DIR --tiny      # small: checks it runs
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from loramux_engine.lora.host_buffers import HostBuffer, populate  # noqa: E402
from loramux_engine.lora.shared_memory import SegmentCutter  # noqa: E402


class Probe:
    """The stand-in step thread: samples of how late a 1 ms beat was (CPU) or how long a
    small launch and its synchronize took (CUDA), in ms."""

    def __init__(self, cuda: bool):
        self.cuda, self.samples, self._stop = cuda, [], threading.Event()
        self._x = torch.zeros(1024, device="cuda") if cuda else None
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:   # one sample at least, however short the work
            t = time.perf_counter()
            if self.cuda:
                self._x.add_(1)
                torch.cuda.synchronize()
                self.samples.append(1e3 * (time.perf_counter() - t))
                time.sleep(0.001)
            else:
                time.sleep(0.001)
                self.samples.append(1e3 * (time.perf_counter() - t) - 1.0)
            if self._stop.is_set():
                return

    def __enter__(self) -> "Probe":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        s = sorted(self.samples) or [float("nan")]
        return {"probe_median_ms": round(statistics.median(s), 3),
                "probe_p99_ms": round(s[int(0.99 * (len(s) - 1))], 3),
                "probe_max_ms": round(s[-1], 3)}


def fresh_buffers(size: int, count: int) -> list[HostBuffer]:
    cutter = SegmentCutter()
    out = []
    for _ in range(count):
        data, place = cutter.cut(size)
        out.append(HostBuffer(data, size, None, shared=place))
    return out


def row(name: str, cuda: bool, work, nbytes: int) -> dict:
    with Probe(cuda) as probe:
        t = time.perf_counter()
        work()
        seconds = time.perf_counter() - t
    return {"phase": name, "seconds": round(seconds, 3),
            "gb_per_s": round(nbytes / seconds / 1e9, 2) if nbytes else None,
            **probe.summary()}


def run(size: int, count: int, threads: list[int], cuda: bool, idle_s: float) -> list[dict]:
    rows = [row("nothing (the probe alone)", cuda, lambda: time.sleep(idle_s), 0)]
    for n in threads:
        bufs = fresh_buffers(size, count)

        def work(bufs=bufs, n=n):
            with ThreadPoolExecutor(n) as pool:
                assert all(pool.map(lambda b: populate(b.data, b.nbytes), bufs)), \
                    "MADV_POPULATE_WRITE failed (Linux before 5.14?)"
        rows.append(row(f"populate, {n} thread{'s' * (n > 1)}", cuda, work, size * count))
        if cuda and n == threads[0]:   # the populated buffers, page-locked one at a time
            rows.append(row("cudaHostRegister, 1 thread", cuda,
                            lambda bufs=bufs: [b.register() for b in bufs], size * count))
        del bufs
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| phase | s | GB/s | probe median / p99 / max ms |", "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['phase']} | {r['seconds']} | {r['gb_per_s'] or '-'} | "
                     f"{r['probe_median_ms']} / {r['probe_p99_ms']} / {r['probe_max_ms']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="8 buffers of 4 MB, 1 and 2 threads")
    p.add_argument("--size-mb", type=int, default=None, help="buffer size (default: 84)")
    p.add_argument("--buffers", type=int, default=None, help="buffers per row (default: 48)")
    p.add_argument("--threads", default=None, help="thread counts (default: 1,4,14)")
    p.add_argument("--out", default=None, help="directory for first_touch.json")
    args = p.parse_args(argv)
    size = (args.size_mb or (4 if args.tiny else 84)) << 20
    count = args.buffers or (8 if args.tiny else 48)
    threads = [int(t) for t in (args.threads or ("1,2" if args.tiny else "1,4,14")).split(",")]
    cuda = torch.cuda.is_available()
    rows = run(size, count, threads, cuda, idle_s=0.5 if args.tiny else 2.0)
    result = {"cuda": cuda, "buffer_bytes": size, "buffers": count, "rows": rows}
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "first_touch.json").write_text(json.dumps(result, indent=2))
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
