"""The longest gap between engine steps while a large adapter is loaded through the
engine server (the path AdapterAdmin.LoadAdapter takes), on the CPU.

    python benchmarks/experiments/bench_adapter_read_gap.py [--rank 704] [--out DIR]

A Llama-shaped model (hidden 1024, 16 layers, random weights, nothing downloaded) is
served by a real EngineServer on loopback ZMQ; one request decodes throughout. The
script measures the gaps between consecutive StepBatch messages for a few seconds
without any load (baseline), then sends a LoadAdapter command for a random PEFT adapter
of about 500 MB (bf16, all seven projections; rank 704 by default) and measures the gaps
until the load's ack arrives. Reading happens on a reader thread, so the longest gap
should stay near the baseline's rather than near the read time. Prints a table; writes
adapter_read_gap.json to --out when given.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
import zmq

sys.path.append(str(Path(__file__).resolve().parents[2]))  # last: hides nothing installed
from benchmarks import llama8b  # noqa: E402  (model dir and adapter writers)
from benchmarks.common import report  # noqa: E402

SHAPE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=16,
             num_attention_heads=16, num_key_value_heads=8, head_dim=64, vocab_size=32000)


def write_model(root: Path) -> Path:
    model = llama8b.write_model_dir(root / "model")
    cfg = {**json.loads((model / "config.json").read_text()), **SHAPE}
    (model / "config.json").write_text(json.dumps(cfg, indent=2))
    return model


def step_gaps(sub, until, timeout_s: float) -> tuple[list[float], object]:
    """Gaps between StepBatch arrivals until `until(msg)`; (gaps, the matching message)."""
    from loramux_core.v1 import engine_pb2

    last, gaps, deadline = None, [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not sub.poll(50):
            continue
        msg = engine_pb2.EngineOutput.FromString(sub.recv())
        now = time.monotonic()
        if msg.WhichOneof("kind") == "step_batch":
            if last is not None:
                gaps.append(now - last)
            last = now
        if until(msg, now):
            return gaps, msg
    raise TimeoutError(f"nothing matched in {timeout_s} s")


def run(model: Path, adapter: Path, rank: int, baseline_s: float) -> dict:
    from loramux_core.v1 import engine_pb2

    from loramux_engine import Engine, EngineConfig
    from loramux_engine.server.loop import EngineServer, ServerConfig
    from loramux_services.launcher import free_port

    eng = Engine(EngineConfig(model=str(model), device="cpu", load_format="dummy",
                              max_loras=1, max_lora_rank=rank, num_kv_blocks=256))
    inp, out = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = EngineServer(eng, ServerConfig(inp, out))
    stop = threading.Event()
    loop = threading.Thread(target=server.serve_forever, args=(stop,))
    loop.start()
    ctx = zmq.Context.instance()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(out)
    push.connect(inp)
    try:
        time.sleep(0.5)
        req = engine_pb2.EngineGenerate(request_id="base", prompt_token_ids=[5, 6, 7])
        req.sampling.max_tokens, req.sampling.ignore_eos = 3000, True
        push.send(engine_pb2.EngineInput(generate=req).SerializeToString())
        t_base = time.monotonic() + baseline_s
        base, _ = step_gaps(sub, lambda m, now: now > t_base, baseline_s + 60)
        push.send(engine_pb2.EngineInput(adapter_command=engine_pb2.AdapterCommand(
            command_id="load", kind=engine_pb2.ADAPTER_COMMAND_KIND_LOAD, name="big",
            path=str(adapter))).SerializeToString())
        t0 = time.monotonic()
        during, ack = step_gaps(sub, lambda m, now: m.WhichOneof("kind") == "adapter_ack",
                                600)
        load_s = time.monotonic() - t0
    finally:
        stop.set()
        loop.join(30)
        sub.close(0)
        push.close(0)
        eng.close()
    if not ack.adapter_ack.ok:
        raise RuntimeError(f"load failed: {ack.adapter_ack.message}")
    return {"adapter_mb": (adapter / "adapter_model.safetensors").stat().st_size / 1e6,
            "rank": rank, "load_s": load_s, "torch_threads": torch.get_num_threads(),
            "baseline_step_p50_s": statistics.median(base), "baseline_step_max_s": max(base),
            "steps_during_load": len(during),
            "max_gap_during_load_s": max(during) if during else load_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rank", type=int, default=704, help="704: a ~507 MB bf16 adapter")
    ap.add_argument("--baseline-s", type=float, default=5.0)
    ap.add_argument("--workdir", default=None, help="where the model and adapter are written")
    ap.add_argument("--out", default=None, help="directory for adapter_read_gap.json")
    args = ap.parse_args(argv)
    root = Path(args.workdir or tempfile.mkdtemp(prefix="bench-read-gap-"))
    model = write_model(root)
    adapter = root / f"adapter-r{args.rank}"
    if not (adapter / "adapter_model.safetensors").exists():
        llama8b.write_adapter(adapter, model, rank=args.rank)
    r = run(model, adapter, args.rank, args.baseline_s)
    report(args.out, "adapter_read_gap.json", r, {
        "adapter (MB)": f"{r['adapter_mb']:.0f}", "load until ack (s)": f"{r['load_s']:.2f}",
        "step p50 / max without load (ms)":
            f"{r['baseline_step_p50_s'] * 1e3:.0f} / {r['baseline_step_max_s'] * 1e3:.0f}",
        "steps during load": str(r["steps_during_load"]),
        "longest step gap during load (ms)": f"{r['max_gap_during_load_s'] * 1e3:.0f}"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
