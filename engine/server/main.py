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
    p.add_argument("--device", default=env("LORAMUX_DEVICE", "auto"),
                   help="auto (CUDA when a GPU is present, else cpu), cuda, cuda:N or cpu")
    p.add_argument("--dtype", default=env("LORAMUX_DTYPE", "auto"),
                   help="auto (bfloat16 on GPUs that support it, else float16; float32 on "
                        "the CPU), bfloat16, float16 or float32")
    p.add_argument("--max-loras", type=_auto_int, default=env("LORAMUX_MAX_LORAS", "auto"),
                   help="adapter slots on the device (auto: as many rank-max_lora_rank "
                        "adapters as a third of the GPU memory left after weights holds; 4 on "
                        "the CPU)")
    p.add_argument("--max-cpu-loras", type=_auto_int, default=env("LORAMUX_MAX_CPU_LORAS", "auto"),
                   help="adapter copies in host memory (auto: half the available host "
                        "memory; 4 x max_loras on the CPU)")
    p.add_argument("--max-lora-rank", type=int, default=int(env("LORAMUX_MAX_LORA_RANK", "64")))
    p.add_argument("--max-num-seqs", type=_auto_int, default="auto",
                   help="running requests at most (auto: 256 on a GPU, 64 on the CPU)")
    p.add_argument("--max-num-batched-tokens", type=_auto_int, default="auto",
                   help="tokens per step (auto: 8192 on a GPU, 512 on the CPU)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory this engine may use; the KV cache gets "
                        "what weights, adapter slots and activations leave")
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="fixed KV block count (default: sized from the memory)")
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
    p.add_argument("--shutdown-grace", type=float,
                   default=float(env("LORAMUX_SHUTDOWN_GRACE", "30")),
                   help="on SIGTERM/SIGINT, running requests have this many seconds to "
                        "finish; new ones are refused (default: 30)")
    p.add_argument("--heartbeat-interval", type=float, default=0.2,
                   help="seconds between heartbeats (sent from their own thread: a long "
                        "step does not delay them)")
    p.add_argument("--stall-timeout", type=float, default=600.0,
                   help="heartbeats stop while one step-loop iteration has run this many "
                        "seconds (a hung engine then looks dead to its peers)")
    p.add_argument("--debug-step-sleep", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--ready-file", default=None,
                   help="write {instance_id, input, output} here as JSON once serving")
    return p


def adapter_roots(args) -> list[str]:
    return args.adapter_root or [r for r in os.environ.get("LORAMUX_ADAPTER_ROOTS", "").split(":")
                                 if r]


def _auto_int(value):
    """An int, or None for "auto" (the engine decides: engine/resolve.py)."""
    if value in (None, "", "auto"):
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer or 'auto'") from None


def engine_config(args):
    from engine.config import EngineConfig

    return EngineConfig(
        model=args.model, device=args.device, dtype=args.dtype, max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len, num_kv_blocks=args.num_kv_blocks,
        gpu_memory_utilization=args.gpu_memory_utilization,
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
    server = EngineServer(engine, ServerConfig(
        args.input, args.output, heartbeat_interval_s=args.heartbeat_interval,
        stall_timeout_s=args.stall_timeout, debug_step_sleep_s=args.debug_step_sleep))
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
          f"instance={server.instance_id} {engine.describe()}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(stop, args.shutdown_grace)
    finally:
        engine.close()  # joins the other tensor-parallel ranks, if any
    return 0
