"""EngineServer: the engine's step loop behind a PULL (input) and a PUB (output) socket.

One thread does everything, in this order, forever: drain the input socket (bounded),
apply adapter commands, admit and abort requests, run one engine step, publish one
StepBatch for the whole step, and publish heartbeats/events when due. Heartbeats come
from this same loop on purpose: a hung loop stops them, so peers detect it."""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import zmq
from loramux.v1 import engine_pb2

from engine.server.adapter_commands import AdapterCommands
from engine.server.convert import delta_to_proto, error_code, sampling_from_proto
from engine.server.events import engine_event, max_model_len

_MAX_INPUTS_PER_ITERATION = 512


@dataclass(frozen=True)
class ServerConfig:
    input_address: str             # bound PULL socket, e.g. tcp://127.0.0.1:5555
    output_address: str            # bound PUB socket
    heartbeat_interval_s: float = 0.2
    event_interval_s: float = 0.5


class EngineServer:
    """Serves one Engine over ZMQ until `stop` is set."""

    def __init__(self, engine, cfg: ServerConfig, ctx: zmq.Context | None = None):
        self.engine = engine
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex
        self._ctx = ctx or zmq.Context.instance()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pub = self._ctx.socket(zmq.PUB)
        for sock in (self._pull, self._pub):
            sock.setsockopt(zmq.LINGER, 0)
        self._pull.bind(cfg.input_address)
        self._pub.bind(cfg.output_address)
        self.adapters = AdapterCommands(engine)
        self._live: set[str] = set()
        self._stopping = False
        self._step = 0
        self._hb_seq = 0
        self._next_heartbeat = 0.0
        self._next_event = 0.0

    def serve_forever(self, stop: threading.Event, drain_s: float = 0.0) -> None:
        """Serve until `stop` is set, then drain for up to `drain_s` seconds."""
        try:
            while not stop.is_set():
                self._iterate()
            self._drain_requests(drain_s)
        finally:
            self._pull.close(0)
            self._pub.close(0)

    def _drain_requests(self, grace_s: float) -> None:
        """Stopping: new requests are refused (UNAVAILABLE), running ones go on for up to
        `grace_s`; then a short tail of heartbeats lets the last tokens leave the socket."""
        self._stopping = True
        deadline = time.monotonic() + grace_s
        while self.engine.has_unfinished() and time.monotonic() < deadline:
            self._iterate()
        tail = time.monotonic() + (0.2 if grace_s > 0 else 0.0)
        while time.monotonic() < tail:
            self._iterate()

    def _iterate(self) -> None:
        busy = self.engine.has_unfinished()
        wait_ms = 0 if busy else max(0, int((self._next_heartbeat - time.monotonic()) * 1000))
        batch = engine_pb2.StepBatch()
        if self._pull.poll(wait_ms):
            self._drain(batch)
        if self.engine.has_unfinished():
            self._step += 1
            batch.step = self._step
            for out in self.engine.step():
                batch.deltas.append(delta_to_proto(out))
                if out.finished:
                    self._live.discard(out.request_id)
        if batch.deltas or batch.errors:
            self._publish(step_batch=batch)
        self._periodic()

    def _drain(self, batch: engine_pb2.StepBatch) -> None:
        for _ in range(_MAX_INPUTS_PER_ITERATION):
            try:
                raw = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = engine_pb2.EngineInput()
            try:
                msg.ParseFromString(raw)
            except Exception:  # noqa: BLE001 - a garbled message must not stop the engine
                continue
            self._handle(msg, batch)

    def _handle(self, msg: engine_pb2.EngineInput, batch: engine_pb2.StepBatch) -> None:
        kind = msg.WhichOneof("kind")
        if kind == "generate":
            self._add_request(msg.generate, batch)
        elif kind == "abort":
            for rid in msg.abort.request_ids:
                if rid in self._live:
                    self._live.discard(rid)
                    self.engine.abort(rid)
        elif kind == "adapter_command":
            self._publish(adapter_ack=self.adapters.apply(msg.adapter_command))
            self._next_event = 0.0  # residency changed: tell the control plane soon

    def _add_request(self, req: engine_pb2.EngineGenerate, batch: engine_pb2.StepBatch) -> None:
        if self._stopping:
            batch.errors.add(request_id=req.request_id, code=engine_pb2.ERROR_CODE_UNAVAILABLE,
                             message="the engine is shutting down")
            return
        try:
            params = sampling_from_proto(req.sampling)
            self.engine.add_request(req.request_id, list(req.prompt_token_ids), params,
                                    req.adapter or None)
        except Exception as exc:  # noqa: BLE001 - the caller gets the typed status
            batch.errors.add(request_id=req.request_id, code=error_code(exc),
                             message=str(exc) or type(exc).__name__)
            return
        self._live.add(req.request_id)

    def _periodic(self) -> None:
        now = time.monotonic()
        if now >= self._next_heartbeat:
            self._next_heartbeat = now + self.cfg.heartbeat_interval_s
            self._hb_seq += 1
            mc = self.engine.model_config
            self._publish(heartbeat=engine_pb2.Heartbeat(
                instance_id=self.instance_id, seq=self._hb_seq,
                max_model_len=max_model_len(self.engine), vocab_size=mc.vocab_size,
                in_flight_requests=len(self._live), unix_time=time.time()))
        if now >= self._next_event:
            self._next_event = now + self.cfg.event_interval_s
            self._publish(event=engine_event(self.engine.stats(), self.adapters.loaded))

    def _publish(self, **kind) -> None:
        out = engine_pb2.EngineOutput(instance_id=self.instance_id, **kind)
        self._pub.send(out.SerializeToString())
