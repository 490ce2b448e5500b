"""Command line of the engine server (`python -m loramux_engine.server`)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading
import traceback

from loramux_core import curve, open_audit
from loramux_core.gc_heap import freeze_heap
from loramux_core.options import (ENGINE_OPTIONS, OneLineErrors, add_options,
                                  auto_non_negative_int, config_error_message, given,
                                  non_negative_float, positive_float)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = OneLineErrors(prog="python -m loramux_engine.server",
                      description="Run the loramux engine behind ZMQ sockets.")
    p.add_argument("--model", default=env("LORAMUX_MODEL"), help="HF model directory")
    p.add_argument("--input", default=env("LORAMUX_ENGINE_INPUT"),
                   help="address to bind the PULL socket for requests and commands")
    p.add_argument("--output", default=env("LORAMUX_ENGINE_OUTPUT"),
                   help="address to bind the PUB socket for tokens, acks, events, heartbeats")
    # a deployment setting shared with the control plane, not an EngineConfig option of
    # the engine table: `loramux serve` gives both processes the same roots
    p.add_argument("--adapter-root", action="append", default=None,
                   help="directory adapters may be read from (repeatable; "
                        "$LORAMUX_ADAPTER_ROOTS, ':'-separated); none: every adapter "
                        "directory the control plane names is its own root")
    add_options(p.add_argument_group("engine (each also an environment variable, "
                                      "see loramux_core/options.py)"), ENGINE_OPTIONS)
    p.add_argument("--shutdown-grace", type=non_negative_float,
                   default=env("LORAMUX_SHUTDOWN_GRACE", "30"),
                   help="on SIGTERM/SIGINT, running requests have this many seconds to "
                        "finish; new ones are refused (default: 30)")
    p.add_argument("--heartbeat-interval", type=positive_float, default=0.2,
                   help="seconds between heartbeats (sent from their own thread: a long "
                        "step does not delay them)")
    p.add_argument("--stall-timeout", type=positive_float, default=600.0,
                   help="heartbeats stop while one step-loop iteration has run this many "
                        "seconds (a hung engine then looks dead to its peers)")
    p.add_argument("--debug-step-sleep", type=non_negative_float, default=0.0,
                   help=argparse.SUPPRESS)
    p.add_argument("--debug-sleep-step", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--compile-workers", type=auto_non_negative_int,
                   default=env("LORAMUX_COMPILE_WORKERS", "auto"),
                   help="processes that compile the warm-up's kernel variants in parallel "
                        "before it runs, on a GPU whose compile cache lacks them "
                        "(default: auto: half the cores, at most 8; 0: none)")
    # test hook: run the warm-up where it has nothing to compile (the CPU), to see it
    p.add_argument("--debug-warm-up", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--ready-file", default=None,
                   help="write {instance_id, input, output} here as JSON once serving")
    curve.add_arguments(p)
    return p


def engine_config(args, environ=None):
    """The EngineConfig the flags (then the environment variables) ask for; fields given
    neither way keep EngineConfig's defaults. Raises InvalidRequestError or
    argparse.ArgumentTypeError (a bad environment value)."""
    from loramux_engine.config import EngineConfig

    from loramux_core.safe_files import roots_from

    return EngineConfig(model=args.model, adapter_roots=roots_from(args.adapter_root, environ),
                        **given(args, ENGINE_OPTIONS, environ))


def resolved_config(engine) -> dict:
    """Every EngineConfig field as the engine resolved it (no "auto", no None but
    max_model_len/num_kv_blocks given their measured values)."""
    out = dataclasses.asdict(engine.config)
    out.update(max_model_len=engine.max_model_len, num_kv_blocks=engine.num_kv_blocks)
    return out


LOADERS_DURING_WARM_UP = 4


def start_engine(args, config, progress):
    """Build the engine of `config` (LOADING) and warm it up (WARMING_UP), reporting to
    `progress`; None (said on stderr) when the configuration is refused."""
    from loramux_engine.engine import Engine
    from loramux_engine.precompile import precompile
    from loramux_core.errors import EngineDeadError, LoramuxError
    from loramux_core.v1 import engine_pb2

    progress.enter(engine_pb2.ENGINE_PHASE_LOADING, "loading weights, sizing the KV cache")
    try:
        engine = Engine(config)
    except (LoramuxError, argparse.ArgumentTypeError) as err:
        print(f"error: {config_error_message(str(err))}", file=sys.stderr)
        return None
    loaders = engine.adapter_loaders if engine.device.type == "cuda" else None
    if loaders is not None:
        # a few loaders import torch while kernels compile, not when the first adapter
        # loads; the rest (a dozen on a 16-core host) after the warm-up, whose compile
        # workers they would otherwise compete with for the cores
        loaders.start_in_background(up_to=LOADERS_DURING_WARM_UP)
    progress.enter(engine_pb2.ENGINE_PHASE_WARMING_UP, "starting")
    try:  # before the ready file: no request meets a compile
        compiled = precompile(engine, args.compile_workers, progress)
        if compiled is not None:
            print(f"engine {compiled}", file=sys.stderr, flush=True)
        report = engine.warm_up(progress=progress, force=args.debug_warm_up,
                                only=None if compiled is None else compiled.shapes)
    except EngineDeadError as err:  # a tensor-parallel rank stopped part-way: the others
        # may wait in a collective forever, so this engine cannot serve (exit: restarted)
        print(f"error: engine warm-up failed: {err}", file=sys.stderr, flush=True)
        engine.close()
        raise SystemExit(1) from err
    except Exception as err:  # serving still works: kernels then compile on first use
        print(f"engine warm-up failed, serving without it: {err!r}", file=sys.stderr,
              flush=True)
    else:
        if report is not None:
            print(f"engine {report} (loading {progress.seconds.get('loading', 0):.1f} s)",
                  file=sys.stderr, flush=True)
    if loaders is not None:
        loaders.start_in_background()
    return engine


def main(argv: list[str] | None = None) -> int:
    open_audit.install_from_env("engine")
    args = build_parser().parse_args(argv)
    for name in ("model", "input", "output"):
        if not getattr(args, name):
            print(f"error: --{name} is required (or set LORAMUX_{'MODEL' if name == 'model' else 'ENGINE_' + name.upper()})",
                  file=sys.stderr)
            return 2
    try:
        keys = curve.keys_from_args(args)
    except curve.ZmqKeyError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    from loramux_engine.server.loop import EngineServer, ServerConfig
    from loramux_engine.startup import ProgressLine, StartupProgress
    from loramux_core.errors import LoramuxError

    try:   # the flags and environment first: a bad value is one line, nothing bound
        config = engine_config(args, os.environ)
    except (LoramuxError, argparse.ArgumentTypeError) as err:
        print(f"error: {config_error_message(str(err))}", file=sys.stderr)
        return 2

    # the sockets first: the replica is seen (heartbeats with its phase and progress)
    # while it loads and warms up, and a taken address fails before anything slow
    progress = StartupProgress(on_update=ProgressLine())
    server = EngineServer(None, ServerConfig(
        args.input, args.output, heartbeat_interval_s=args.heartbeat_interval,
        stall_timeout_s=args.stall_timeout, debug_step_sleep_s=args.debug_step_sleep,
        debug_sleep_step=args.debug_sleep_step, keys=keys), progress=progress)
    server.start_heartbeats()
    try:
        engine = start_engine(args, config, progress)
    except BaseException:
        server.close()
        raise
    if engine is None:
        server.close()
        return 2
    # the model, kernels and graphs live until exit: a full collection never walks them
    frozen = freeze_heap()
    server.attach(engine)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.ready_file:
        tmp = args.ready_file + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"instance_id": server.instance_id, "input": args.input,
                       "output": args.output, "pid": os.getpid(),
                       "gc_frozen": frozen,
                       "config": resolved_config(engine)}, f)
        os.replace(tmp, args.ready_file)
    print(f"engine serving: input={args.input} output={args.output} "
          f"instance={server.instance_id} zmq={'curve' if keys else 'INSECURE'} "
          f"{engine.describe()}", file=sys.stderr, flush=True)
    try:
        server.serve_forever(stop, args.shutdown_grace)
    finally:
        engine.close()  # joins the other tensor-parallel ranks, if any
        if engine.executor.dead and engine.device.type == "cuda":
            # a lost rank: NCCL's teardown at interpreter exit may wait for the lost peer
            # forever, and what supervises this process (loramux serve, Kubernetes) sees
            # the engine's death only once the process has exited
            if sys.exc_info()[0] is not None:
                traceback.print_exc()
            print("engine: a tensor-parallel rank was lost; exiting", file=sys.stderr,
                  flush=True)
            os._exit(3)
    return 0
