"""Command line of the engine server (`python -m engine.server`)."""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="python -m engine.server",
                                description="Run the loramux engine behind ZMQ sockets.")
    p.add_argument("--model", default=env("LORAMUX_MODEL"), help="HF model directory")
    p.add_argument("--input", default=env("LORAMUX_ENGINE_INPUT"),
                   help="address to bind the PULL socket for requests and commands")
    p.add_argument("--output", default=env("LORAMUX_ENGINE_OUTPUT"),
                   help="address to bind the PUB socket for tokens, acks, events, heartbeats")
    p.add_argument("--device", default=env("LORAMUX_DEVICE", "cpu"))
    p.add_argument("--dtype", default=env("LORAMUX_DTYPE", "float32"))
    p.add_argument("--max-loras", type=int, default=int(env("LORAMUX_MAX_LORAS", "4")))
    p.add_argument("--max-cpu-loras", type=int, default=None)
    p.add_argument("--max-lora-rank", type=int, default=int(env("LORAMUX_MAX_LORA_RANK", "64")))
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--tensor-parallel-size", type=int, default=int(env("LORAMUX_TP_SIZE", "1")))
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", choices=("auto", "on", "off"),
                   default=env("LORAMUX_ASYNC_SCHEDULING", "auto"),
                   help="launch step N+1 before reading step N's tokens; auto: on for one "
                        "CUDA device, off otherwise")
    p.add_argument("--adapter-root", action="append", default=None,
                   help="directory adapters may be read from (repeatable; "
                        "$LORAMUX_ADAPTER_ROOTS, ':'-separated); none: every adapter "
                        "directory the control plane names is its own root")
    p.add_argument("--heartbeat-interval", type=float, default=0.2)
    p.add_argument("--ready-file", default=None,
                   help="write {instance_id, input, output} here as JSON once serving")
    return p


def adapter_roots(args) -> list[str]:
    return args.adapter_root or [r for r in os.environ.get("LORAMUX_ADAPTER_ROOTS", "").split(":")
                                 if r]


def engine_config(args):
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        block_size=args.block_size, tp_size=args.tensor_parallel_size,
        enforce_eager=args.enforce_eager, adapter_roots=tuple(adapter_roots(args)),
        async_scheduling={"auto": None, "on": True, "off": False}[args.async_scheduling])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name in ("model", "input", "output"):
        if not getattr(args, name):
            print(f"error: --{name} is required (or set LORAMUX_{'MODEL' if name == 'model' else 'ENGINE_' + name.upper()})",
                  file=sys.stderr)
            return 2
    from engine.engine import Engine
    from engine.server.loop import EngineServer, ServerConfig

    engine = Engine(engine_config(args))
    server = EngineServer(engine, ServerConfig(args.input, args.output,
                                               heartbeat_interval_s=args.heartbeat_interval))
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"instance_id": server.instance_id, "input": args.input,
                       "output": args.output, "pid": os.getpid()}, f)
        os.replace(tmp, args.ready_file)
    print(f"engine serving: input={args.input} output={args.output} "
          f"instance={server.instance_id}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(stop)
    finally:
        engine.close()  # joins the other tensor-parallel ranks, if any
    return 0
