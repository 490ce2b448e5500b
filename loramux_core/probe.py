"""Waits for an engine heartbeat on its output socket: the engine's health check.

`python -m loramux_core.probe tcp://host:port [--timeout S] [--zmq-keys DIR] [--serving]`
exits 0 once a heartbeat arrives, 1 when none does in time. An engine heartbeats while it
loads and warms up too: a heartbeat says it is alive (a liveness or start-up probe);
`--serving` waits for one whose phase is SERVING (a readiness probe). The keys default to
$LORAMUX_ZMQ_KEYS (the engine admits no subscriber without them)."""
from __future__ import annotations

import os
import sys
import time

import zmq

from loramux_core.curve import KEYS_ENV, ZmqKeyError, ZmqKeys
from loramux_core.v1 import engine_pb2

_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


_SERVES = (engine_pb2.ENGINE_PHASE_SERVING, engine_pb2.ENGINE_PHASE_UNSPECIFIED)


def wait_heartbeat(output_address: str, timeout_s: float = 5.0,
                   keys: ZmqKeys | None = None, serving: bool = False
                   ) -> engine_pb2.Heartbeat | None:
    """The first heartbeat published on `output_address` (when `serving`, the first that
    says the engine serves), or None after `timeout_s`."""
    def wanted(m: engine_pb2.EngineOutput) -> bool:
        return m.WhichOneof("kind") == "heartbeat" and (
            not serving or m.heartbeat.phase in _SERVES)
    out = wait_output(output_address, wanted, timeout_s, keys=keys)
    return None if out is None else out.heartbeat


def wait_output(output_address: str, predicate, timeout_s: float = 5.0,
                last: list | None = None, keys: ZmqKeys | None = None
                ) -> engine_pb2.EngineOutput | None:
    """The first EngineOutput on `output_address` with predicate(msg) true, or None after
    `timeout_s`. If `last` is given, every message seen is appended to it. `keys`: the
    run's CURVE keys (loramux_services.launcher.Cluster.zmq_keys); an engine that refuses the
    handshake (keys missing or not the run's) raises ZmqKeyError at once."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        keys.connect(sub)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    monitor = sub.get_monitor_socket(_HANDSHAKE_FAILED)
    sub.connect(output_address)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    deadline = time.monotonic() + timeout_s
    try:
        while (left := deadline - time.monotonic()) > 0:
            ready = dict(poller.poll(int(left * 1000)))
            if monitor in ready:
                why = "keys not the run's" if keys else "no CURVE keys given"
                raise ZmqKeyError(f"{output_address} refused the handshake ({why}); pass the "
                                  "run's keys (keys=cluster.zmq_keys)")
            if sub not in ready:
                break
            msg = engine_pb2.EngineOutput.FromString(sub.recv())
            if last is not None:
                last.append(msg)
            if predicate(msg):
                return msg
        return None
    finally:
        sub.disable_monitor()
        monitor.close(0)
        sub.close(0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    timeout = float(argv[argv.index("--timeout") + 1]) if "--timeout" in argv else 5.0
    key_dir = argv[argv.index("--zmq-keys") + 1] if "--zmq-keys" in argv else os.environ.get(KEYS_ENV)
    keys = ZmqKeys.load(key_dir) if key_dir else None
    serving = "--serving" in argv
    return 0 if wait_heartbeat(argv[0], timeout, keys, serving) is not None else 1


if __name__ == "__main__":
    sys.exit(main())
