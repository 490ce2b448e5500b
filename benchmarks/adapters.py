"""Adapter movement and loads: `python -m benchmarks.adapters [CASE] --out DIR [options]`
(benchmarks/suite.py).

    loads     AddAdapter of an 84 MB adapter (one, 16 at once) and LoadAdapter of thousands
              through the service, per block of loads
    pipeline  disk -> host reads, AddAdapter, host -> slot swaps, decode steps with swaps
    offproc   what cold loads cost a decoding engine: loader processes against reads on its
              own threads (--paths 4,0; "u": buffers page-locked unpopulated)
    stress    the long run of the adapter lifecycle stress (--ops N; CPU)
    admin     AdapterAdmin loads at scale through the service (concurrent LoadAdapter calls
              and LoadAdapters batches) and the decode step of live streams meanwhile
    stages    the CPU of one 84 MB load, stage by stage, in process and through a loader
              process (read, digest, header checks, conversion, bounds, fresh pages)
    first-touch  fresh host memory: populate on 1..N threads (GB/s) and page-locking, with
              a stand-in step thread's stalls meanwhile
"""
from __future__ import annotations

import sys

from benchmarks.suite import Case, main

CASES = {
    "loads": Case("benchmarks.bench_adapter_loads", "AddAdapter and LoadAdapter at scale",
                  devices=("cuda", "cpu"), device_flag=True),
    "pipeline": Case("benchmarks.bench_adapter_pipeline", "reads, loads, swaps, steps with swaps",
                     devices=("cuda", "cpu"), device_flag=True),
    "offproc": Case("benchmarks.bench_offproc_loads", "loads during decode, by load path",
                    devices=("cpu", "cuda"), device_flag=True),
    "stress": Case("benchmarks.stress_lifecycle", "adapter lifecycle stress, long run",
                   devices=("cpu",)),
    "admin": Case("benchmarks.bench_admin_loads", "AdapterAdmin loads/s and decode meanwhile",
                  tiny=("--tiny",)),
    "stages": Case("benchmarks.bench_load_stages", "the CPU of one adapter load, by stage",
                   devices=("cpu",), tiny=("--tiny",)),
    "first-touch": Case("benchmarks.bench_first_touch", "fresh host memory and the step",
                        devices=("cuda", "cpu"), tiny=("--tiny",)),
}

if __name__ == "__main__":
    sys.exit(main("adapters", CASES))
