"""An EngineServer on loopback ZMQ in a thread of the test process, with a PUSH socket to
its input and a SUB socket on its output (a real engine and real sockets, no processes)."""
from __future__ import annotations

import threading
import time

import zmq

from loramux_engine.server.loop import EngineServer, ServerConfig
from loramux_core.v1 import engine_pb2
from loramux_services.launcher import free_port


class ServedEngine:
    def __init__(self, engine, **server_kw):
        inp, self.output = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
        self.server = EngineServer(engine, ServerConfig(inp, self.output, **server_kw))
        self._stop = threading.Event()
        self._loop = threading.Thread(target=self.server.serve_forever, args=(self._stop,))
        ctx = zmq.Context.instance()
        self._sub, self._push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(self.output)
        self._push.connect(inp)

    def __enter__(self) -> "ServedEngine":
        self._loop.start()
        # a heartbeat on our own SUB socket: it has joined, so nothing sent from now on
        # can be published before it listens (the slow joiner), however slow the machine
        try:
            self.collect(lambda m: m.WhichOneof("kind") == "heartbeat", timeout_s=60)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._loop.join(10)
        self._sub.close(0)
        self._push.close(0)

    def send(self, **kind) -> None:
        self._push.send(engine_pb2.EngineInput(**kind).SerializeToString())

    def generate(self, request_id: str, prompt: list[int], max_tokens: int,
                 adapter: str = "") -> None:
        req = engine_pb2.EngineGenerate(request_id=request_id, prompt_token_ids=prompt,
                                        adapter=adapter)
        req.sampling.max_tokens = max_tokens
        req.sampling.temperature = 0.0
        req.sampling.ignore_eos = True
        self.send(generate=req)

    def command(self, command_id: str, kind: str, name: str, path: str = "",
                pinned: bool = False) -> None:
        k = getattr(engine_pb2.AdapterCommandKind, f"ADAPTER_COMMAND_KIND_{kind.upper()}")
        self.send(adapter_command=engine_pb2.AdapterCommand(
            command_id=command_id, kind=k, name=name, path=path, pinned=pinned))

    def collect(self, until, timeout_s: float = 30.0
                ) -> list[tuple[float, engine_pb2.EngineOutput]]:
        """(arrival time, message) of every output until `until(msg)` is true (included)."""
        out, deadline = [], time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._sub.poll(50):
                msg = engine_pb2.EngineOutput.FromString(self._sub.recv())
                out.append((time.monotonic(), msg))
                if until(msg):
                    return out
        raise TimeoutError(f"no matching output in {timeout_s} s; saw {len(out)} messages")
