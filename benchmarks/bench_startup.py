"""Start time of an engine server, on a fresh machine and with the Triton compile cache of
an earlier start: `python -m loramux_engine.server` of a Llama-3-8B-shaped model (random weights,
load_format=dummy) started twice in one call, the first time with an empty
TRITON_CACHE_DIR, the second with the cache the first one left.

Each run is watched from outside, as a supervisor would: the seconds from the process's
start to its first heartbeat (sockets bound), to the first WARMING_UP heartbeat (weights
in GPU memory), to the first SERVING heartbeat and to its ready file; and the warm-up's
own report line (eager shapes, layers per step, graphs, seconds of each part, kernel
variants compiled or loaded from the cache), from its stderr.

    python -m benchmarks.serving startup --out DIR [--layers 32] [--runs fresh,warm]

Writes DIR/startup.json and each run's engine log (DIR/engine-fresh.log, ...).

Extra engine flags after `--` go to both runs (e.g. `-- --max-num-seqs 128`)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path += [str(REPO), str(REPO / "benchmarks")]  # last: hides nothing installed

from llama8b import write_model_dir  # noqa: E402
from loramux_core.v1 import engine_pb2  # noqa: E402
from loramux_services.launcher import free_port  # noqa: E402

PHASES = {engine_pb2.ENGINE_PHASE_LOADING: "loading",
          engine_pb2.ENGINE_PHASE_WARMING_UP: "warming_up",
          engine_pb2.ENGINE_PHASE_SERVING: "serving"}


def start_once(model: Path, work: Path, cache: Path, extra: list[str],
               timeout_s: float) -> dict:
    """One engine server start; the seconds of each milestone from the process start."""
    inp, out = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ready = work / "ready.json"
    ready.unlink(missing_ok=True)
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(out)
    log_path = work / "engine.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "loramux_engine.server", "--model", str(model), "--input", inp,
             "--output", out, "--insecure-zmq", "--load-format", "dummy",
             "--ready-file", str(ready), *extra],
            env=env, cwd=work, stdout=log, stderr=subprocess.STDOUT)
    seen: dict[str, float] = {}
    try:
        while "ready_file" not in seen or "serving" not in seen:
            if proc.poll() is not None:
                raise RuntimeError(f"engine exited {proc.returncode}: "
                                   f"{log_path.read_text()[-2000:]}")
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"not serving after {timeout_s} s")
            if sub.poll(20):
                hb = engine_pb2.EngineOutput.FromString(sub.recv())
                if hb.WhichOneof("kind") == "heartbeat":
                    seen.setdefault("first_heartbeat", time.monotonic() - t0)
                    seen.setdefault(PHASES.get(hb.heartbeat.phase, "unspecified"),
                                    time.monotonic() - t0)
            if ready.exists():
                seen.setdefault("ready_file", time.monotonic() - t0)
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        sub.close(0)
    text = log_path.read_text()
    report = re.findall(r"engine warm-up \d.*", text)
    seen["warm_up_report"] = report[-1] if report else None
    if "warming_up" in seen and "serving" in seen:
        seen["serving_after_weights_s"] = seen["serving"] - seen["warming_up"]
    return seen


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: 32)")
    p.add_argument("--runs", default="fresh,warm",
                   help="comma-separated: fresh (empty compile cache), warm (the cache "
                        "of the run before)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", required=True, help="directory for startup.json and the engine logs")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        root = Path(tmp)
        model = write_model_dir(root / "model", num_layers=args.layers)
        cache = root / "triton-cache"
        results = {}
        for run in args.runs.split(","):
            if run == "fresh" and cache.exists():
                shutil.rmtree(cache)
            work = root / run
            work.mkdir()
            try:
                results[run] = start_once(model, work, cache, extra, args.timeout)
            finally:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                shutil.copy(work / "engine.log", Path(args.out) / f"engine-{run}.log")
            print(run, json.dumps(results[run], indent=1), flush=True)
    (Path(args.out) / "startup.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
