"""Where the CPU of one adapter load goes, stage by stage, at the real size: a rank-16
adapter of the Llama-3-8B shape (84 MB, bf16, all seven projections; benchmarks/llama8b.py)
read from the page cache, on the CPU, no model.

    python -m benchmarks.adapters stages --out DIR            # 84 MB adapter
    python -m benchmarks.adapters stages --out DIR --tiny     # the tiny shape: checks it runs

In the engine's process, each stage alone (median of --repeat, wall and process CPU,
every thread counted): the file read into the reused scratch buffer (open inside the
root, O_NOFOLLOW, read), its version digest alone (BLAKE3 chunks, one thread; the read
hashes on several), the v1 digest (sha256 chunks) that only a read checked against a
version recorded before costs, the header parse and shape checks (a
plan of the same bytes without the PlanCache), the conversion into the host layout
(dtype, scaling, stacked layout) and the bounds check of the values. Then whole loads
through one loader process (engine/adapters/loader_pool.py) into shared buffers: wall
time per load, the child's CPU and the engine's, with buffers reused (the host copy of
the previous load dropped) and with fresh buffers (every host copy kept, as when
thousands of adapters are loaded: each buffer's pages are new to the kernel).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # last: hides nothing installed
from benchmarks.bench_admin_loads import TINY  # noqa: E402
from benchmarks.llama8b import LLAMA3_8B, write_adapter, write_model_dir  # noqa: E402


def timed(fn, repeat: int) -> tuple[dict, object]:
    """(median wall and CPU ms of `fn()` over `repeat` runs after one warm-up, its last
    result)."""
    walls, cpus, out = [], [], fn()
    for _ in range(repeat):
        w, c = time.perf_counter(), time.process_time()
        out = fn()
        cpus.append(1e3 * (time.process_time() - c))
        walls.append(1e3 * (time.perf_counter() - w))
    return {"wall_ms": round(statistics.median(walls), 1),
            "cpu_ms": round(statistics.median(cpus), 1)}, out


def in_process(model: Path, root: Path, name: str, repeat: int) -> dict:
    from loramux_engine.lora.host_buffers import HostBufferPool
    from loramux_engine.lora.weights import _all_within_bounds, weights_from_plan
    from loramux_core.adapter.plan import WEIGHTS_NAME, plan_adapter
    from loramux_core.file_digest import file_digest, file_digest_v1
    from loramux_core.model.hf_config import ModelConfig
    from loramux_core.safe_files import AdapterRoots

    mc = ModelConfig.from_dir(str(model))
    roots, pool = AdapterRoots([str(root)]), HostBufferPool()
    scratch = pool.scratch.acquire((root / name / WEIGHTS_NAME).stat().st_size)
    into = memoryview(scratch.data.numpy())

    def read():   # the read hashes each chunk as it lands; wait for the digest
        with roots.open_dir(name) as d:
            fr = d.read(WEIGHTS_NAME, 1 << 34, lambda n: into)
        fr.digest
        return fr
    rows = {}
    rows["open+read+digest"], fr = timed(read, repeat)
    rows["blake3 digest alone"], _ = timed(lambda: file_digest(fr.data), repeat)
    rows["v1 sha256 digest alone"], _ = timed(lambda: file_digest_v1(fr.data), repeat)
    rows["header+checks"], _ = timed(
        lambda: plan_adapter(str(root / name), mc, 16, roots, header_only=True), repeat)
    plan = plan_adapter(str(root / name), mc, 16, roots)
    dtype = torch.bfloat16

    def convert():
        w = weights_from_plan(plan, mc, dtype=dtype, buffers=pool)
        return w
    rows["convert+bounds"], w = timed(convert, repeat)
    values = w.buffer.data[:w.buffer_bytes].view(dtype)
    rows["bounds"], _ = timed(lambda: _all_within_bounds(values), repeat)
    rows["bytes"] = fr.data.nbytes
    return rows


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the third (state) on."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def child_cpu_s(pid: int) -> float:
    fields = _stat(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def through_loader(model: Path, root: Path, names: list[str], keep: bool) -> dict:
    """Loads of `names` through one loader process: median wall, child CPU, engine CPU."""
    from loramux_engine.adapters.loader_pool import LoaderPool, LoaderSpec
    from loramux_engine.lora.host_buffers import HostBufferPool
    from loramux_core.model.hf_config import ModelConfig
    from loramux_core.model.lora_targets import lora_group_shapes

    mc = ModelConfig.from_dir(str(model))
    spec = LoaderSpec(str(model), 16, "bfloat16", (str(root),))
    pool = LoaderPool(spec, HostBufferPool(shared=True), lora_group_shapes(mc, 1),
                      torch.bfloat16, processes=1)
    pool.start()
    pid, held, walls, childs, engines = pool.pids()[0], [], [], [], []
    niceness = int(_stat(pid)[16])
    try:
        pool.read(str(root / names[0]), None)  # warm: imports, plans, scratch
        gc.collect()
        for n in names:
            c0, e0, w0 = child_cpu_s(pid), time.process_time(), time.perf_counter()
            w = pool.read(str(root / n), None)
            walls.append(1e3 * (time.perf_counter() - w0))
            childs.append(1e3 * (child_cpu_s(pid) - c0))
            engines.append(1e3 * (time.process_time() - e0))
            if keep:
                held.append(w)
            del w
            gc.collect()
    finally:
        pool.close()
    return {"wall_ms": round(statistics.median(walls), 1),
            "child_cpu_ms": round(statistics.median(childs), 1),
            "engine_cpu_ms": round(statistics.median(engines), 1), "loads": len(names),
            "niceness": niceness}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="the tiny model's shape")
    p.add_argument("--repeat", type=int, default=5, help="runs per in-process stage")
    p.add_argument("--loads", type=int, default=8, help="loads per loader-process row")
    p.add_argument("--out", default=None, help="directory for stages.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)   # as in a loader process
    with tempfile.TemporaryDirectory(prefix="load-stages-") as tmp:
        model = write_model_dir(Path(tmp) / "model", base=TINY if args.tiny else LLAMA3_8B)
        root = Path(tmp) / "adapters"
        write_adapter(root / "a0", model, rank=16, seed=0)
        names = ["a0"]
        for i in range(1, args.loads):   # hard links: the page cache serves every read
            (root / f"a{i}").mkdir()
            for f in (root / "a0").iterdir():
                os.link(f, root / f"a{i}" / f.name)
            names.append(f"a{i}")
        result = {"cpu_count": os.cpu_count(), "tiny": args.tiny,
                  "stages": in_process(model, root, "a0", args.repeat),
                  "loader_reused": through_loader(model, root, names, keep=False),
                  "loader_fresh": through_loader(model, root, names, keep=True)}
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "stages.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
