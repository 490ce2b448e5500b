"""The service under load: `python -m benchmarks.serving [CASE] --out DIR [options]`
(benchmarks/suite.py).

    run       the real service (`loramux serve`'s launcher and defaults) driven through
              the client SDK, and the same workload through the offline engine
              (--adapters, --popularity, --rate/--concurrency, --points ...; after `--`,
              flags for `loramux serve`); --tiny: the demo model on the CPU
    defaults  the engine's automatic defaults on this GPU under the heaviest load they allow
    startup   an engine server's start, with an empty and then a warm compile cache: seconds
              to its first heartbeat, to the weights in memory, to serving (--runs fresh,warm)
"""
from __future__ import annotations

import sys

from benchmarks.suite import Case, main

CASES = {
    "run": Case("benchmarks.bench_serving", "service against the offline engine",
                tiny=("--tiny",)),
    "defaults": Case("benchmarks.check_gpu_defaults", "serve's memory-sized defaults on a GPU"),
    "startup": Case("benchmarks.bench_startup", "start time, fresh and with a warm compile cache"),
}

if __name__ == "__main__":
    sys.exit(main("serving", CASES))
