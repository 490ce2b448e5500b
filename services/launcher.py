"""Runs control plane, engine replicas and gateway as separate local processes (`loramux
serve`, and the end-to-end tests). Each process can be stopped, killed and restarted alone
on the same addresses. With one replica its process is "engine"; with N, "engine-0" ..
"engine-{N-1}", each on its own devices (consecutive GPUs, a tensor-parallel group each).
Each Cluster makes fresh CURVE keys for the ZMQ sockets in `<workdir>/zmq-keys` (0700), so
only its own processes can use them."""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from loramux_core.curve import ZmqKeys, generate_keys


def engine_names(replicas: int) -> tuple[str, ...]:
    return ("engine",) if replicas == 1 else tuple(f"engine-{i}" for i in range(replicas))


def device_sets(replicas: int, tp_size: int, visible: str | None) -> list[str]:
    """The CUDA devices of each replica ($CUDA_VISIBLE_DEVICES values): `tp_size`
    consecutive ones each, from `visible` (the launcher's own $CUDA_VISIBLE_DEVICES) or
    from device 0."""
    pool = [d.strip() for d in visible.split(",")] if visible else \
        [str(i) for i in range(replicas * tp_size)]
    if len(pool) < replicas * tp_size:
        raise ValueError(f"{replicas} replica(s) of {tp_size} device(s) each need "
                         f"{replicas * tp_size} devices; CUDA_VISIBLE_DEVICES names {len(pool)}")
    return [",".join(pool[i * tp_size:(i + 1) * tp_size]) for i in range(replicas)]


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now (the OS picks it); used to fix addresses before start so a
    restarted process comes back on the same ones."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterConfig:
    model: str
    adapter_roots: tuple[str, ...]
    workdir: str
    host: str = "127.0.0.1"
    gateway_port: int = 0            # 0: a free port
    control_port: int = 0
    metrics_port: int = -1           # -1: no metrics server
    http_port: int = -1              # -1: no HTTP API; 0: a free port
    auth_token: str | None = None
    tensor_parallel_size: int = 1
    replicas: int = 1                # engine replicas (each tensor_parallel_size devices)
    shutdown_grace_s: float = 30.0   # in-flight streams' time to finish on stop
    engine_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    control_args: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    insecure_zmq: bool = False       # True: no CURVE keys, any local process may connect


class Cluster:
    def __init__(self, cfg: ClusterConfig):
        self.cfg = cfg
        self.workdir = Path(cfg.workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.engine_names = engine_names(cfg.replicas)
        self.services = (*self.engine_names, "control", "gateway")
        self.engines: list[tuple[str, str]] = [("", "")] * cfg.replicas
        for name in self.services:
            self._pick(name)
        self.db = str(self.workdir / "registry.sqlite")
        self.zmq_keys: ZmqKeys | None = (
            None if cfg.insecure_zmq else generate_keys(self.workdir / "zmq-keys"))
        self.procs: dict[str, subprocess.Popen] = {}
        self._fresh: set[str] = set()         # started, ready file not yet read
        self._log_from: dict[str, int] = {}   # where each process's log of this start begins
        self.rebinds: list[str] = []          # addresses picked again (see wait_ready)

    def command(self, name: str) -> list[str]:
        c = self.cfg
        common = ["--model", c.model, *(["--zmq-keys", self.zmq_keys.directory]
                                        if self.zmq_keys else ["--insecure-zmq"])]
        roots = [a for r in c.adapter_roots for a in ("--adapter-root", r)]
        if name in self.engine_names:
            engine_input, engine_output = self.engines[self.engine_names.index(name)]
            return [sys.executable, "-m", "loramux_engine.server", *common, *roots,
                    "--input", engine_input,
                    "--output", engine_output, "--tensor-parallel-size",
                    str(c.tensor_parallel_size), "--ready-file", self._ready(name),
                    "--shutdown-grace", str(c.shutdown_grace_s), *c.engine_args]
        links = ["--engine-input", ",".join(i for i, _ in self.engines),
                 "--engine-output", ",".join(o for _, o in self.engines),
                 "--table-address", self.table_address, "--ready-file", self._ready(name)]
        if name == "control":
            token = ["--auth-token", c.auth_token] if c.auth_token else []
            return [sys.executable, "-m", "loramux_services.control", *common, *links, *roots,
                    *token,
                    "--listen", self.control_address, "--db", self.db, *c.control_args]
        http = ["--http-port", str(self.http_port)] if self.http_port > 0 else []
        token = ["--auth-token", c.auth_token] if c.auth_token else []
        return [sys.executable, "-m", "loramux_services.gateway", *common, *links, *roots,
                "--listen", self.gateway_address, "--metrics-port", str(c.metrics_port),
                "--shutdown-grace", str(c.shutdown_grace_s), *http, *token, *c.gateway_args]

    def _ready(self, name: str) -> str:
        return str(self.workdir / f"{name}.ready.json")

    def environment(self, name: str) -> dict:
        """The environment of service `name`."""
        # compiled Triton kernels persist in the work dir: a restart loads, not compiles
        env = {"TRITON_CACHE_DIR": str(self.workdir / "triton-cache"), **os.environ, **self.cfg.env}
        visible = env.get("CUDA_VISIBLE_DEVICES")
        if name in self.engine_names and self.cfg.replicas > 1 and visible != "":
            sets = device_sets(self.cfg.replicas, self.cfg.tensor_parallel_size, visible)
            env["CUDA_VISIBLE_DEVICES"] = sets[self.engine_names.index(name)]
        return env

    def start(self, *names: str) -> None:
        """Start the named services (all by default) at once."""
        for name in names or self.services:
            ready = Path(self._ready(name))
            ready.unlink(missing_ok=True)
            env = self.environment(name)
            log = open(self.workdir / f"{name}.log", "ab")
            self._log_from[name] = log.tell()
            self._fresh.add(name)
            # own session: a terminal's Ctrl-C reaches the launcher only, which stops the
            # services in drain order (close) instead of all at once
            self.procs[name] = subprocess.Popen(self.command(name), stdout=log, stderr=log,
                                                env=env, start_new_session=True)
            log.close()

    def wait_ready(self, *names: str, timeout_s: float = 120.0) -> dict[str, dict]:
        """Wait until each named process wrote its ready file; raise if one died."""
        deadline = time.monotonic() + timeout_s
        out = {}
        for name in names or self.services:
            ready = Path(self._ready(name))
            while not ready.exists():
                proc = self.procs[name]
                if proc.poll() is not None:
                    if self._rebind(name):
                        continue
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not ready after {timeout_s} s:\n{self.log_tail(name)}")
                time.sleep(0.05)
            out[name] = json.loads(ready.read_text())
            self._fresh.discard(name)
        return out

    # Addresses are picked before the processes start (so that a restart comes back on the
    # same ones), and another process of the machine may bind a picked port before ours
    # does. A process that left before it was ready because its address was taken starts
    # again on freshly picked ones, with the processes that connect to it, when those have
    # not been ready yet either (nobody holds the old address then). A port the
    # configuration fixed is never changed: its conflict is the caller's error.
    _MAX_REBINDS = 5

    def _pick(self, name: str) -> None:
        """Pick the addresses service `name` binds (a configured port stays as it is)."""
        c, h = self.cfg, self.cfg.host
        if name in self.engine_names:
            self.engines[self.engine_names.index(name)] = (f"tcp://{h}:{free_port(h)}",
                                                           f"tcp://{h}:{free_port(h)}")
            self.engine_input, self.engine_output = self.engines[0]
        elif name == "control":
            self.table_address = f"tcp://{h}:{free_port(h)}"
            self.control_address = f"{h}:{c.control_port or free_port(h)}"
        elif name == "gateway":
            self.gateway_address = f"{h}:{c.gateway_port or free_port(h)}"
            self.http_port = c.http_port if c.http_port != 0 else free_port(h)
            self.http_address = f"{h}:{self.http_port}" if self.http_port > 0 else None

    def _dependents(self, name: str) -> tuple[str, ...]:
        """The services that connect to what `name` binds."""
        return (("control", "gateway") if name in self.engine_names else
                ("gateway",) if name == "control" else ())

    def _addresses(self) -> list[str]:
        return [a for pair in self.engines for a in pair] + [
            self.table_address, self.control_address, self.gateway_address, str(self.http_port)]

    def _log_of_start(self, name: str) -> str:
        """What process `name` logged since it was last started."""
        path = self.workdir / f"{name}.log"
        if not path.exists():
            return ""
        with open(path, "rb") as f:
            f.seek(self._log_from.get(name, 0))
            return f.read().decode(errors="replace")

    def _rebind(self, name: str) -> bool:
        """Start `name` again on fresh addresses if it left because one was taken (see
        above); False when that is not the case or not possible."""
        log = self._log_of_start(name)
        if (len(self.rebinds) >= self._MAX_REBINDS or name not in self._fresh
                or "Address already in use" not in log):
            return False
        c = self.cfg
        fixed = ([c.control_port] if name == "control" else
                 [c.gateway_port, c.http_port, c.metrics_port] if name == "gateway" else [])
        if any(p > 0 and re.search(rf"\b{p}\b", log) for p in fixed):
            return False  # a configured port may be the taken one
        running = [d for d in self._dependents(name)
                   if d in self.procs and self.procs[d].poll() is None]
        if any(d not in self._fresh for d in running):
            return False  # one of them is serving on the old address: leave it be
        before = self._addresses()
        self._pick(name)
        moved = [f"{old} -> {new}" for old, new in zip(before, self._addresses()) if old != new]
        if not moved:
            return False  # every address it binds was configured
        self.rebinds.append(f"{name}: " + ", ".join(moved))
        print(f"launcher: {name} could not bind an address picked for it (another process "
              f"took it first); starting it again on new ones: {self.rebinds[-1]}",
              file=sys.stderr, flush=True)
        for d in running:
            self.stop(d, signal.SIGKILL)
        self.procs.pop(name, None)
        self.start(name, *running)
        return True

    def wait_output(self, predicate, timeout_s: float = 5.0, last: list | None = None):
        """The first message on the engine's output socket with predicate(msg) true, read
        with this run's keys (loramux_core.probe.wait_output); None after `timeout_s`."""
        from loramux_core.probe import wait_output

        return wait_output(self.engine_output, predicate, timeout_s, last=last, keys=self.zmq_keys)

    def log_path(self, name: str) -> Path:
        """Where service `name` logs (every start appends)."""
        return self.workdir / f"{name}.log"

    def is_ready(self, name: str) -> bool:
        """Service `name` wrote its ready file since it was last started."""
        return Path(self._ready(name)).exists()

    def log_tail(self, name: str, n: int = 4000) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 20.0) -> int | None:
        """Signal one service and wait for it (SIGKILL after timeout); its exit code."""
        proc = self.procs.pop(name, None)
        if proc is None or proc.poll() is not None:
            return None if proc is None else proc.returncode
        proc.send_signal(sig)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def kill(self, name: str) -> None:
        self.stop(name, signal.SIGKILL)

    def close(self, timeout_s: float = 20.0) -> None:
        """Stop in drain order: the gateway first (it refuses new calls and gives in-flight
        ones `shutdown_grace_s` to finish), then the control plane and the engines together.
        A process still there `timeout_s` after its grace is killed."""
        self._stop_together(("gateway",), self.cfg.shutdown_grace_s + timeout_s)
        self._stop_together(("control", *self.engine_names), timeout_s)

    def kill_all(self) -> None:
        self._stop_together(self.services, 5.0, signal.SIGKILL)

    def _stop_together(self, names, timeout_s: float, sig: int = signal.SIGTERM) -> None:
        procs = [(n, self.procs[n]) for n in names if n in self.procs]
        for _, proc in procs:
            if proc.poll() is None:
                proc.send_signal(sig)
        deadline = time.monotonic() + timeout_s
        for name, proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            self.procs.pop(name, None)  # only once gone: an interrupted close can kill it

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_serving(address: str, timeout_s: float = 60.0, tls=None) -> None:
    """Wait until the gRPC server at `address` reports overall health SERVING (for the
    gateway that means: an engine is connected); `tls`: a loramux.TLS for a TLS port."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from loramux.tls import channel

    deadline = time.monotonic() + timeout_s
    with channel(address, tls) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} is not SERVING after {timeout_s} s")
            time.sleep(0.1)
