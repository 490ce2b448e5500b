"""The command line of `loramux serve`: the engine's and the gateway's option tables (the
same flags their own processes take), the launcher's addresses and files, `--config FILE`.

`plan(args)` turns parsed arguments into a ClusterConfig, forwarding only what the user
set (the processes' own defaults, "auto" mostly, decide the rest)."""
from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from loramux_core.options import (ENGINE_OPTIONS, OneLineErrors, add_options, config_error_message,
                                  given, non_negative_float, positive_float, positive_int,
                                  to_argv)
from loramux_services.config_file import ConfigFileError, defaults_from_file
from loramux_services.gateway.main import GATEWAY_OPTIONS
from loramux_services.supervisor import RestartPolicy

DESCRIPTION = ("Run control plane, engine (or --replicas engine replicas) and gateway on "
               "this machine.")


def _port(allow_off: bool):
    lo = -1 if allow_off else 0

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a port number") from None
        if not lo <= value <= 65535:
            raise argparse.ArgumentTypeError(
                f"{value} is not a port in [{lo}, 65535]{' (-1: off)' if allow_off else ''}")
        return value
    return parse


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrors(prog="loramux serve", description=DESCRIPTION)
    p.add_argument("--config", metavar="FILE",
                   help="YAML or TOML file of these options by name (max_loras: 8); flags "
                        "given here override it")
    p.add_argument("--model", help="HF model directory (default: the demo model)")
    p.add_argument("--adapter-root", action="append", default=None,
                   help="directory adapters may be registered from (repeatable; default: "
                        "the model directory)")
    add_options(p.add_argument_group("engine"), ENGINE_OPTIONS)
    add_options(p.add_argument_group("gateway"), GATEWAY_OPTIONS)
    r = p.add_argument_group("replicas")
    r.add_argument("--replicas", type=positive_int, default=1,
                   help="engine replicas behind the one gateway and control plane, each on "
                        "its own devices: replica i gets GPUs i*T .. i*T+T-1 of "
                        "$CUDA_VISIBLE_DEVICES (T: --tensor-parallel-size); the gateway routes "
                        "each request by adapter residency and load (default: 1)")
    s = p.add_argument_group("addresses, files, stopping")
    s.add_argument("--host", default="127.0.0.1", help="address the services listen on "
                   "(default: 127.0.0.1)")
    s.add_argument("--gateway-port", type=_port(False), default=50051,
                   help="gRPC Generate port (default: 50051; 0 picks a free one)")
    s.add_argument("--control-port", type=_port(False), default=50052,
                   help="gRPC AdapterAdmin port (default: 50052; 0 picks a free one)")
    s.add_argument("--metrics-port", type=_port(True), default=9090,
                   help="Prometheus /metrics port (default: 9090; -1: off)")
    s.add_argument("--http-port", type=_port(False), default=8000,
                   help="OpenAI-compatible HTTP API port (default: 8000; 0: off)")
    s.add_argument("--auth-token", default=None,
                   help="bearer token for admin calls and the HTTP API")
    s.add_argument("--workdir", default=None, help="registry and logs (default: a temp dir "
                   "for the demo, <cache>/serve otherwise)")
    s.add_argument("--cache-dir", default=None, help="where the demo model is made")
    s.add_argument("--shutdown-grace", type=non_negative_float, default=30.0,
                   help="seconds in-flight streams may take to finish on stop (default: 30)")
    v = p.add_argument_group("supervision: a dead process starts again after a backoff")
    v.add_argument("--restart-backoff", type=positive_float, default=RestartPolicy.backoff_s,
                   help="seconds before the first restart of a dead process, doubled on each "
                        "death (default: %(default)s)")
    v.add_argument("--restart-backoff-max", type=positive_float,
                   default=RestartPolicy.max_backoff_s,
                   help="longest wait before a restart (default: %(default)s)")
    v.add_argument("--crash-loop-deaths", type=positive_int,
                   default=RestartPolicy.crash_loop_deaths,
                   help="this many deaths of one process within --crash-loop-window stop the "
                        "service (default: %(default)s)")
    v.add_argument("--crash-loop-window", type=positive_float,
                   default=RestartPolicy.crash_loop_window_s,
                   help="seconds (default: %(default)s)")
    t = p.add_argument_group("TLS on the gateway (gRPC and HTTP) and control plane ports")
    t.add_argument("--tls-cert", help="PEM certificate (chain) the ports serve")
    t.add_argument("--tls-key", help="its PEM private key")
    t.add_argument("--tls-client-ca", help="require client certificates this PEM CA signed (mTLS)")
    t.add_argument("--tls-ca", help="CA that signed --tls-cert, for this launcher's own checks "
                   "(default: --tls-cert itself, i.e. a self-signed certificate)")
    t.add_argument("--tls-server-name", help="name in --tls-cert to check, when not --host")
    t.add_argument("--tls-client-cert", help="this launcher's client certificate (needed "
                   "with --tls-client-ca)")
    t.add_argument("--tls-client-key", help="its PEM private key")
    t.add_argument("--allow-plaintext-token", action="store_true",
                   help="accept --auth-token on a non-loopback --host without TLS")
    return p


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """Parsed arguments, `--config FILE` applied under the flags; bad values exit with one
    line naming the flag (or the file's key)."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.config:
        try:
            parser.set_defaults(**defaults_from_file(parser, known.config))
        except ConfigFileError as err:
            parser.error(str(err))
    args = parser.parse_args(argv)
    args.engine = given(args, ENGINE_OPTIONS, with_defaults=False)
    args.gateway = given(args, GATEWAY_OPTIONS, with_defaults=False)
    _check_engine(parser, args)
    _check_tls(parser, args)
    _check_devices(parser, args)
    return args


def _check_devices(parser, args) -> None:
    import os

    from loramux_services.launcher import device_sets

    if args.replicas > 1 and args.engine.get("device", "auto") != "cpu":
        try:
            device_sets(args.replicas, args.engine.get("tp_size", 1),
                        os.environ.get("CUDA_VISIBLE_DEVICES"))
        except ValueError as err:
            parser.error(f"--replicas: {err}")


def _check_tls(parser, args) -> None:
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    if args.tls_client_ca and not (args.tls_cert and args.tls_client_cert and args.tls_client_key):
        parser.error("--tls-client-ca needs --tls-cert/--tls-key, and --tls-client-cert/"
                     "--tls-client-key for this launcher's own health checks")


def tls_flags(args) -> tuple[str, ...]:
    """The TLS flags the gateway and the control plane both get."""
    flags = ["--allow-plaintext-token"] if args.allow_plaintext_token else []
    if args.tls_cert:
        flags += ["--tls-cert", args.tls_cert, "--tls-key", args.tls_key]
    if args.tls_client_ca:
        flags += ["--tls-client-ca", args.tls_client_ca]
    return tuple(flags)


def client_tls(args):
    """How this launcher reaches its own TLS ports (a loramux.TLS), or None."""
    if not args.tls_cert:
        return None
    from loramux.tls import TLS

    return TLS(args.tls_ca or args.tls_cert, args.tls_client_cert, args.tls_client_key,
               args.tls_server_name)


def _check_engine(parser, args) -> None:
    """What the engine's config refuses across fields (max_cpu_loras < max_loras, ...), said
    before any process starts."""
    from loramux_core.engine_config import EngineSettings
    from loramux_core.errors import InvalidRequestError

    try:
        EngineSettings(model=args.model or "", **args.engine)
    except InvalidRequestError as err:
        parser.error(config_error_message(str(err)))


@dataclass(frozen=True)
class Plan:
    model: str
    adapter_roots: tuple[str, ...]
    workdir: str
    demo: bool


def files(args) -> Plan:
    """Model, adapter roots and work dir (the demo model is made here, once)."""
    from loramux_services.demo_model import default_cache_dir, ensure_demo

    demo = args.model is None
    roots = list(args.adapter_root or [])
    if demo:
        model = str(ensure_demo(args.cache_dir))
        roots = [str(Path(model) / "adapters"), *roots]
    else:
        model, roots = args.model, roots or [args.model]
    workdir = args.workdir or (tempfile.mkdtemp(prefix="loramux-serve-") if demo
                               else str(default_cache_dir() / "serve"))
    return Plan(model, tuple(roots), workdir, demo)


def restart_policy(args) -> RestartPolicy:
    return RestartPolicy(backoff_s=args.restart_backoff, max_backoff_s=max(
        args.restart_backoff, args.restart_backoff_max), crash_loop_deaths=args.crash_loop_deaths,
        crash_loop_window_s=args.crash_loop_window)


def cluster_config(args, plan: Plan):
    from loramux_services.launcher import ClusterConfig

    engine = dict(args.engine)
    tp = engine.pop("tp_size", 1)
    shared = {k: engine[k] for k in ("max_lora_rank",) if k in engine}  # control checks it too
    heartbeat = {k: args.gateway[k] for k in ("heartbeat_timeout",) if k in args.gateway}
    gateway = dict(args.gateway)
    if plan.demo:
        from loramux_services.demo_model import SERVED_NAME
        gateway.setdefault("served_model_name", SERVED_NAME)
    return ClusterConfig(
        model=plan.model, adapter_roots=plan.adapter_roots, workdir=plan.workdir,
        host=args.host, gateway_port=args.gateway_port, control_port=args.control_port,
        metrics_port=args.metrics_port, http_port=args.http_port or -1,
        auth_token=args.auth_token, tensor_parallel_size=tp, replicas=args.replicas,
        shutdown_grace_s=args.shutdown_grace,
        engine_args=tuple(to_argv(engine, ENGINE_OPTIONS)),
        gateway_args=tuple(to_argv(gateway, GATEWAY_OPTIONS)) + tls_flags(args),
        control_args=tuple(to_argv(shared, ENGINE_OPTIONS) + to_argv(heartbeat, GATEWAY_OPTIONS))
        + tls_flags(args))
