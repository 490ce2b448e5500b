"""Adapter movement and loads: `python -m benchmarks.adapters [CASE] --out DIR [options]`
(benchmarks/suite.py).

    loads     AddAdapter of an 84 MB adapter (one, 16 at once) and LoadAdapter of thousands
              through the service, per block of loads
    pipeline  disk -> host reads, AddAdapter, host -> slot swaps, decode steps with swaps
    stress    the long run of the adapter lifecycle stress (--ops N; CPU)
    admin     AdapterAdmin loads at scale through the service (concurrent LoadAdapter calls
              and LoadAdapters batches) and the decode step of live streams meanwhile
    heap      what a full garbage collection walks per host copy, and how long it takes
"""
from __future__ import annotations

import sys

from benchmarks.suite import Case, main

CASES = {
    "loads": Case("benchmarks.bench_adapter_loads", "AddAdapter and LoadAdapter at scale",
                  devices=("cuda", "cpu"), device_flag=True),
    "pipeline": Case("benchmarks.bench_adapter_pipeline", "reads, loads, swaps, steps with swaps",
                     devices=("cuda", "cpu"), device_flag=True),
    "stress": Case("benchmarks.stress_lifecycle", "adapter lifecycle stress, long run",
                   devices=("cpu",)),
    "admin": Case("benchmarks.bench_admin_loads", "AdapterAdmin loads/s and decode meanwhile",
                  tiny=("--tiny",)),
    "heap": Case("benchmarks.bench_host_heap", "gc-tracked objects per host copy, full "
                 "collection time", devices=("cpu",), tiny=("--copies", "50")),
}

if __name__ == "__main__":
    sys.exit(main("adapters", CASES))
