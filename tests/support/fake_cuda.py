"""A stand-in for torch.cuda's streams and events on the CPU, recording what the host
asks of them: every stream keeps its operations in order (event records, event waits,
and whatever a test marks on it), and every host sync (torch.cuda.synchronize,
Event.synchronize, Stream.synchronize) is counted. Nothing runs on a device: the work
itself is done at once by the CPU code that queues it.

`install(monkeypatch)` puts it in place of torch.cuda.Stream, Event, current_stream, stream
and synchronize for one test and returns it.

`covered(waiter, op)`: whether an operation `op` of another stream comes before
something queued now on `waiter`, through the events `waiter` waited on so far."""
from __future__ import annotations

import contextlib

import torch


class FakeStream:
    def __init__(self, cuda: "FakeCuda", name: str):
        self.cuda, self.name = cuda, name
        self.ops: list[tuple] = []
        self.waited: list["FakeEvent"] = []

    def mark(self, *op) -> int:
        """Append an operation; returns its position."""
        self.ops.append(op)
        return len(self.ops) - 1

    def wait_event(self, event: "FakeEvent") -> None:
        self.waited.append(event)
        self.mark("wait", event)

    def wait_stream(self, other: "FakeStream") -> None:
        event = FakeEvent(self.cuda)
        event.record(other)
        self.wait_event(event)

    def synchronize(self) -> None:
        self.cuda.syncs.append(("stream", self.name))

    @property
    def device(self):
        return torch.device("cpu")


class FakeEvent:
    def __init__(self, cuda: "FakeCuda", *args, **kwargs):
        self.cuda = cuda
        self.stream: FakeStream | None = None
        self.pos = -1

    def record(self, stream: FakeStream | None = None) -> None:
        self.stream = stream or self.cuda.current
        self.pos = self.stream.mark("record", self)

    def query(self) -> bool:
        return False  # the slowest legal device: nothing completes on its own

    def synchronize(self) -> None:
        self.cuda.syncs.append(("event", self.stream.name if self.stream else None))


class FakeCuda:
    def __init__(self):
        self.syncs: list[tuple] = []
        self.compute = FakeStream(self, "compute")
        self.current = self.compute
        self.streams = [self.compute]

    def new_stream(self, *args, **kwargs) -> FakeStream:
        s = FakeStream(self, f"side{len(self.streams)}")
        self.streams.append(s)
        return s

    @contextlib.contextmanager
    def use(self, stream: FakeStream):
        prev, self.current = self.current, stream
        try:
            yield stream
        finally:
            self.current = prev

    def covered(self, waiter: FakeStream, stream: FakeStream, pos: int) -> bool:
        """Operation `pos` of `stream` is ordered before what `waiter` queues next."""
        return stream is waiter or any(e.stream is stream and e.pos > pos for e in waiter.waited)


def install(monkeypatch) -> FakeCuda:
    cuda = FakeCuda()
    monkeypatch.setattr(torch.cuda, "Stream", cuda.new_stream)
    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: FakeEvent(cuda, *a, **k))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: cuda.current)
    monkeypatch.setattr(torch.cuda, "stream", cuda.use)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda *a, **k: cuda.syncs.append(("device", None)))
    return cuda
