"""EngineServer: the engine's step loop behind a PULL (input) and a PUB (output) socket.

The step thread does everything, in this order, forever: drain the input socket
(bounded), apply adapter commands, admit and abort requests, register adapters whose
files were read (on reader threads: engine/server/adapter_commands.py), run one engine
step, publish one StepBatch for the whole step, and publish events when due.

Heartbeats come from a thread of their own, so that busy is not mistaken for dead: a
step of a minute (a long prefill on the CPU) never silences them. Death still silences
them: the process gone, the sockets closed, or the step thread making no progress for
`stall_timeout_s` (a hang, not a long step), after which the heartbeat thread stays
quiet until the step thread moves again. The PUB socket is shared by both threads under
a lock (a ZMQ socket may change threads with a memory barrier between uses)."""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass

import zmq

from loramux_engine.server.adapter_commands import AdapterCommands
from loramux_engine.server.convert import delta_to_proto
from loramux_engine.server.events import engine_event, max_model_len
from loramux_engine.startup import StartupProgress
from loramux_engine.telemetry import GcPauses
from loramux_core.curve import ZmqKeys, start_authenticator
from loramux_core.errors import error_code
from loramux_core.pacing import BusyPacer
from loramux_core.sampling import sampling_from_proto
from loramux_core.v1 import engine_pb2

_MAX_INPUTS_PER_ITERATION = 512
_READ_POLL_MS = 5  # idle: how often to look for a finished adapter read


@dataclass(frozen=True)
class ServerConfig:
    input_address: str             # bound PULL socket, e.g. tcp://127.0.0.1:5555
    output_address: str            # bound PUB socket
    heartbeat_interval_s: float = 0.2
    event_interval_s: float = 0.5
    # no heartbeat while one step-loop iteration has run this long: the loop is hung
    stall_timeout_s: float = 600.0
    debug_step_sleep_s: float = 0.0  # test hook: each engine step first sleeps this long
    debug_sleep_step: int = 0        # test hook: 0, every step sleeps; N, only the N-th
    keys: ZmqKeys | None = None    # CURVE keys; None: any local process may connect


class EngineServer:
    """Serves one Engine over ZMQ until `stop` is set.

    The sockets are bound and the heartbeats may start (`start_heartbeats`) before the
    engine exists: `EngineServer(None, cfg)` while the weights load and the kernels warm
    up, the heartbeats telling the phase from `progress`; `attach(engine)` once built.
    Inputs sent meanwhile wait in the PULL socket's queue, read when the loop runs."""

    def __init__(self, engine, cfg: ServerConfig, ctx: zmq.Context | None = None,
                 progress: StartupProgress | None = None):
        self.cfg = cfg
        self.instance_id = uuid.uuid4().hex
        self.progress = progress or StartupProgress()
        self._ctx = ctx or zmq.Context.instance()
        self._auth = start_authenticator(self._ctx, cfg.keys) if cfg.keys else None
        self._pull = self._ctx.socket(zmq.PULL)
        self._pub = self._ctx.socket(zmq.PUB)
        for sock in (self._pull, self._pub):
            sock.setsockopt(zmq.LINGER, 0)
            if cfg.keys:
                cfg.keys.serve(sock)
        self._pull.bind(cfg.input_address)
        self._pub.bind(cfg.output_address)
        self.engine = None
        self.adapters: AdapterCommands | None = None
        self._live: set[str] = set()
        self._stopping = False
        self._step = 0
        self._next_event = 0.0
        self._event_pacer = BusyPacer()  # events sent early, at a residency change
        self._pub_lock = threading.Lock()
        self._progress = time.monotonic()  # the step thread's last completed iteration
        self._limits = (0, 0)  # max_model_len, vocab size: 0 until the engine is built
        self._gc_pauses = GcPauses()  # in every event, timed while serving
        self._beat: threading.Thread | None = None
        self._beat_done = threading.Event()
        if engine is not None:
            self.attach(engine)

    def attach(self, engine) -> None:
        """The engine this server serves, built and warmed up: from now on the heartbeats
        say SERVING (what arrives is read once serve_forever runs)."""
        self.engine = engine
        self.adapters = AdapterCommands(engine)
        self._limits = (max_model_len(engine), engine.model_config.vocab_size)
        self._progress = time.monotonic()
        self.progress.enter(engine_pb2.ENGINE_PHASE_SERVING, "serving")

    def start_heartbeats(self) -> None:
        """Heartbeat from now on, from a thread of their own (idempotent)."""
        if self._beat is None:
            self._beat = threading.Thread(target=self._heartbeats, args=(self._beat_done,),
                                          daemon=True, name="engine-heartbeat")
            self._beat.start()

    def close(self) -> None:
        """Stop the heartbeats and close the sockets (serve_forever does it on its way
        out; call it when the engine never came to serve)."""
        self._beat_done.set()
        if self._beat is not None:
            self._beat.join()
        if self.adapters is not None:
            self.adapters.close()
        self._pull.close(0)
        self._pub.close(0)
        if self._auth:
            self._auth.stop()
            self._auth = None

    def serve_forever(self, stop: threading.Event, drain_s: float = 0.0) -> None:
        """Serve until `stop` is set, then drain for up to `drain_s` seconds."""
        assert self.engine is not None, "attach an engine first"
        with self._gc_pauses:  # from before the first heartbeat says the engine serves
            self._serve(stop, drain_s)

    def _serve(self, stop: threading.Event, drain_s: float) -> None:
        self._progress = time.monotonic()
        self.start_heartbeats()
        try:
            while not stop.is_set():
                self._iterate()
            self._drain_requests(drain_s)
        finally:
            self.close()

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

    def _heartbeats(self, done: threading.Event) -> None:
        seq = 0
        while True:
            snap = self.progress.snapshot()
            # starting: the start-up's last report is its progress; serving: the loop's
            moved = (self._progress if snap.phase == engine_pb2.ENGINE_PHASE_SERVING
                     else snap.updated)
            if time.monotonic() - moved <= self.cfg.stall_timeout_s:
                seq += 1
                self._publish(heartbeat=engine_pb2.Heartbeat(
                    instance_id=self.instance_id, seq=seq, max_model_len=self._limits[0],
                    vocab_size=self._limits[1], in_flight_requests=len(self._live),
                    unix_time=time.time(), phase=snap.phase, phase_detail=snap.detail,
                    phase_progress=snap.progress, phase_eta_s=snap.eta_s))
            if done.wait(self.cfg.heartbeat_interval_s):
                return

    def _iterate(self) -> None:
        busy = self.engine.has_unfinished()
        wait_ms = 0 if busy else max(0, int((self._next_event - time.monotonic()) * 1000))
        if self.adapters.num_reading:
            wait_ms = min(wait_ms, _READ_POLL_MS)
        batch = engine_pb2.StepBatch()
        if self._pull.poll(wait_ms):
            self._drain(batch)
        self._publish_acks(self.adapters.poll())  # adapter reads that finished
        if self.engine.has_unfinished():
            self._step += 1
            batch.step = self._step
            if self.cfg.debug_step_sleep_s and self.cfg.debug_sleep_step in (0, self._step):
                time.sleep(self.cfg.debug_step_sleep_s)
            for out in self.engine.step():
                if out.error is not None:  # the caller gets the status and the reason
                    batch.errors.add(request_id=out.request_id, code=error_code(out.error),
                                     message=str(out.error))
                else:
                    batch.deltas.append(delta_to_proto(out))
                if out.finished:
                    self._live.discard(out.request_id)
        if batch.deltas or batch.errors:
            self._publish(step_batch=batch)
        self._periodic()
        self._progress = time.monotonic()

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
            self._publish_acks(self.adapters.submit(msg.adapter_command))

    def _add_request(self, req: engine_pb2.EngineGenerate, batch: engine_pb2.StepBatch) -> None:
        if self._stopping:
            batch.errors.add(request_id=req.request_id, code=engine_pb2.ERROR_CODE_UNAVAILABLE,
                             message="the engine is shutting down")
            return
        try:
            params = sampling_from_proto(req.sampling)
            self.engine.add_request(req.request_id, list(req.prompt_token_ids), params,
                                    req.adapter or None, list(req.generated_token_ids))
        except Exception as exc:  # noqa: BLE001 - the caller gets the typed status
            batch.errors.add(request_id=req.request_id, code=error_code(exc),
                             message=str(exc) or type(exc).__name__)
            return
        self._live.add(req.request_id)

    def _publish_acks(self, acks) -> None:
        for ack in acks:
            self._publish(adapter_ack=ack)
            # residency changed: tell the control plane soon, but an event lists every
            # adapter, so after a costly one wait a multiple of its cost (a stream of
            # loads then spends a bounded share of the step thread on events, whatever
            # the number of adapters)
            self._next_event = min(self._next_event, self._event_pacer.next_at())

    def _periodic(self) -> None:
        now = time.monotonic()
        if now >= self._next_event:
            self._next_event = now + self.cfg.event_interval_s
            self._publish(event=engine_event(
                self.engine.stats(), self.adapters.loaded,
                [*self.engine.histograms(), self._gc_pauses.histogram]))
            self._event_pacer.ran(now, time.monotonic())

    def _publish(self, **kind) -> None:
        data = engine_pb2.EngineOutput(instance_id=self.instance_id, **kind).SerializeToString()
        with self._pub_lock:
            self._pub.send(data)
