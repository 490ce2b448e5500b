"""Command line of the gateway (`python -m loramux_services.gateway`)."""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

from loramux.v1 import generate_pb2, generate_pb2_grpc

from loramux_core import curve
from loramux_core.gc_heap import freeze_heap
from loramux_core.options import (OneLineErrors, Option, add_options, choice, given,
                                  non_negative_float, positive_float, positive_int)
from loramux_services.common import grpc_server, replicas, service_args, tls
from loramux_services.common.bind_errors import BindError, bind_flag
from loramux_services.common.logs import configure_logging
from loramux_services.gateway.tool_calls import PARSER_NAMES

SERVICE = generate_pb2.DESCRIPTOR.services_by_name["GenerateService"].full_name


# The gateway's tunables; `loramux serve` takes the same flags (loramux_core/options.py).
GATEWAY_OPTIONS = (
    Option("max_inflight", "--max-inflight", positive_int,
           "admission limit: calls beyond it get RESOURCE_EXHAUSTED (default: 1024, four "
           "times the engine's default batch, so bursts wait in the engine's queue)",
           env="LORAMUX_MAX_INFLIGHT", default=1024),
    Option("max_message_bytes", "--max-message-bytes", positive_int,
           "largest request accepted, gRPC message and HTTP body, in bytes; bigger ones are "
           f"refused (default: {grpc_server.DEFAULT_MAX_MESSAGE_BYTES})",
           env="LORAMUX_MAX_MESSAGE_BYTES", default=grpc_server.DEFAULT_MAX_MESSAGE_BYTES),
    Option("heartbeat_timeout", "--heartbeat-timeout", positive_float,
           "seconds without an engine heartbeat before the engine counts as gone and its "
           "streams end with UNAVAILABLE (default: 1.5)", env="LORAMUX_HEARTBEAT_TIMEOUT",
           default=1.5),
    Option("spill_waiting", "--spill-waiting", positive_int,
           "an engine replica with this many requests waiting to be scheduled is saturated: "
           "requests for adapters it holds go to another replica, even one that must load "
           "them first (default: 4)", env="LORAMUX_SPILL_WAITING", default=4),
    Option("served_model_name", "--served-model-name", str,
           "the base model's name in the HTTP API's `model` field and /v1/models "
           "(default: the --model directory's name)",
           env="LORAMUX_SERVED_MODEL_NAME"),
    Option("metrics_max_adapters", "--metrics-max-adapters", positive_int,
           "distinct adapter label values in the gateway's metrics; later adapters count "
           "as 'other' (default: 64)", env="LORAMUX_METRICS_MAX_ADAPTERS", default=64),
    Option("tool_call_parser", "--tool-call-parser", choice(*PARSER_NAMES),
           "the format the HTTP API parses the model's tool calls in under tool_choice "
           "\"auto\": llama3_json, hermes, mistral, none (never parse), or auto: the one "
           "the chat template shows (default: auto)", env="LORAMUX_TOOL_CALL_PARSER",
           default="auto"),
)


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = OneLineErrors(prog="python -m loramux_services.gateway",
                      description="loramux gateway (GenerateService)")
    p.add_argument("--listen", default=env("LORAMUX_GATEWAY_LISTEN", "127.0.0.1:50051"),
                   help="gRPC host:port (port 0 picks a free one)")
    p.add_argument("--model", default=env("LORAMUX_MODEL"),
                   help="base model directory (its tokenizer and context length)")
    p.add_argument("--adapter-root", action="append", default=None,
                   help="directory adapters may be read from (their chat templates; "
                        "repeatable; $LORAMUX_ADAPTER_ROOTS, ':'-separated): the control "
                        "plane's roots")
    replicas.add_arguments(p)
    p.add_argument("--table-address", default=env("LORAMUX_TABLE_ADDRESS"),
                   help="the control plane's adapter-table PUB address")
    add_options(p, GATEWAY_OPTIONS)
    p.add_argument("--http-port", type=int, default=int(env("LORAMUX_HTTP_PORT", "0")),
                   help="OpenAI-compatible HTTP API port, on the --listen host (0: off)")
    p.add_argument("--auth-token", default=env("LORAMUX_AUTH_TOKEN"),
                   help="bearer token the HTTP API requires (default: none)")
    p.add_argument("--metrics-port", type=int, default=int(env("LORAMUX_METRICS_PORT", "9090")),
                   help="Prometheus /metrics HTTP port (0 picks one, -1 disables)")
    p.add_argument("--metrics-host", default=env("LORAMUX_METRICS_HOST", "127.0.0.1"))
    p.add_argument("--shutdown-grace", "--grace", dest="shutdown_grace", type=non_negative_float,
                   default=env("LORAMUX_SHUTDOWN_GRACE", "30"),
                   help="on SIGTERM/SIGINT: new calls get UNAVAILABLE, health goes "
                        "NOT_SERVING, and in-flight calls have this many seconds to finish "
                        "(default: 30)")
    p.add_argument("--ready-file", default=None)
    tls.add_arguments(p)
    curve.add_arguments(p)
    p.add_argument("--log-level", default=env("LORAMUX_LOG_LEVEL", "info"))
    return p


async def _track_health(health, engine) -> None:
    """SERVING exactly while an engine replica is up, so orchestrators route around a
    gateway with none."""
    serving = None
    while True:
        if engine.up != serving:
            serving = engine.up
            await grpc_server.set_serving(health, [SERVICE], serving)
        await asyncio.sleep(0.2)


def _http_server(args, servicer, table):
    from loramux_services.gateway.http_api import OpenAIFront, build_app
    from loramux_services.gateway.http_server import HttpServer

    front = OpenAIFront(servicer, table, model_name=args.served_model_name
                        or served_name(args.model), model_root=args.model)
    host = args.listen.rsplit(":", 1)[0].strip("[]")
    return HttpServer(build_app(front), host, args.http_port, token=args.auth_token,
                      max_body_bytes=args.max_message_bytes, tls=args.tls)


def served_name(model: str) -> str:
    """The base model's default name in the HTTP API: its directory's name, not the path
    (a path tells clients about this machine, and changes when the files move)."""
    return Path(model.rstrip("/")).name or model


async def _drain(grace_s: float, engine, health, health_task, log) -> None:
    """Stop accepting (new calls: UNAVAILABLE; health: NOT_SERVING, still answered so that
    balancers see it), then give in-flight calls up to `grace_s` to finish."""
    engine.draining = True
    health_task.cancel()
    await grpc_server.set_serving(health, [SERVICE], False)
    log.info("draining", grace_s=grace_s, inflight=engine.inflight)
    if not await engine.drained(grace_s):
        log.warning("grace_expired", inflight=engine.inflight)
    log.info("stopping")
    await health.enter_graceful_shutdown()


async def serve(args) -> int:
    from loramux_core.model.hf_config import ModelConfig
    from loramux_core.tokenizer import Tokenizer
    from loramux_services.gateway.adapter_table import AdapterTable
    from loramux_services.gateway.engine_client import EngineClient
    from loramux_services.gateway.engine_metrics import EngineCollector
    from loramux_services.gateway.metrics import GatewayMetrics
    from loramux_services.gateway.prompts import PromptBuilder
    from loramux_services.gateway.servicer import GenerateServicer

    log = configure_logging("gateway", args.log_level)
    from loramux_core.safe_files import AdapterRoots, roots_from
    roots = roots_from(args.adapter_root, os.environ)
    prompts = PromptBuilder(Tokenizer.from_dir(args.model), args.model,
                            adapter_roots=AdapterRoots(roots) if roots else None)
    max_len = ModelConfig.from_dir(args.model).max_position_embeddings
    metrics = GatewayMetrics(args.metrics_max_adapters)
    with bind_flag("--metrics-port", f"{args.metrics_host}:{args.metrics_port}"):
        metrics_port = (metrics.serve(args.metrics_port, args.metrics_host)
                        if args.metrics_port >= 0 else -1)
    table = AdapterTable(args.table_address, keys=args.keys)
    engine = EngineClient(args.engines, max_inflight=args.max_inflight,
                          heartbeat_timeout_s=args.heartbeat_timeout, keys=args.keys,
                          spill_waiting=args.spill_waiting, on_route=metrics.route,
                          on_failover=metrics.failover, replayed=table.replayed)
    metrics.registry.register(EngineCollector(engine, table))
    server = grpc_server.make_server(args.max_message_bytes)
    servicer = GenerateServicer(engine, table, prompts, metrics, max_len,
                                tool_call_parser=args.tool_call_parser)
    generate_pb2_grpc.add_GenerateServiceServicer_to_server(servicer, server)
    health = grpc_server.add_health_and_reflection(server, [SERVICE])
    with bind_flag("--listen", args.listen):
        address = grpc_server.bind(server, args.listen, args.tls)
    with bind_flag("--http-port", f"{args.listen.rsplit(':', 1)[0]}:{args.http_port}"):
        http = _http_server(args, servicer, table) if args.http_port > 0 else None
    await engine.start()
    await table.start()
    await server.start()
    await grpc_server.mark_alive(health)
    if http is not None:
        await http.start()
    health_task = asyncio.create_task(_track_health(health, engine))
    http_address = http.address if http is not None else None
    frozen = freeze_heap()  # what start-up made lives until exit: a full collection never walks it
    grpc_server.write_ready_file(args.ready_file, {"address": address, "metrics_port": metrics_port,
                                                   "http_address": http_address, "pid": os.getpid(),
                                                   "gc_frozen": frozen})
    log.info("serving", address=address, http_address=http_address, metrics_port=metrics_port)
    stop = asyncio.Event()
    grpc_server.install_stop_signals(stop)
    await stop.wait()
    await _drain(args.shutdown_grace, engine, health, health_task, log)
    await asyncio.gather(server.stop(1.0), *([http.stop(1.0)] if http is not None else []))
    await table.close()
    await engine.close()
    prompts.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    from loramux_core import open_audit
    open_audit.install_from_env("gateway")
    args = build_parser().parse_args(argv)
    try:
        vars(args).update(given(args, GATEWAY_OPTIONS, os.environ))
    except argparse.ArgumentTypeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # the HTTP API's bearer token is checked on the --listen host
    why = service_args.check(args, ("model", "engine_input", "engine_output", "table_address"),
                             require_roots=False, check_token=args.http_port > 0)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(serve(args))
    except BindError as err:  # one line naming the flag, not a traceback
        print(f"error: {err}", file=sys.stderr)
        return 2
