"""Adapter reads in a few loader processes, so the engine process does O(1) work per read.

Reading an adapter (file reads, digest, checks, dtype/scaling/layout/TP conversion) costs
CPU and memory bandwidth in whatever process runs it; on threads of the engine process it
slows the step thread (the GIL, the memory bus), by a tenth of the step time with
thousands of adapters. Here each read runs in a child process
(engine/adapters/loader_process.py) that writes the host copy straight into one of the
engine's host buffers, cut from shared memory (engine/lora/shared_memory.py; on CUDA the
engine page-locks them as before, engine/lora/host_buffers.py). The engine only hands
out the buffer and, when the child answers `done`, builds views over it: a host copy is
never seen before the child has finished writing it.

    reader thread (engine)      loader process
      load(path, version)  ──▶  plan, read, hash, check          (same code as in-process)
      acquire(nbytes), fd  ◀─▶  need / buffer                     (loader_wire.py)
      views of the buffer  ◀──  done: places of the tensors       | error: the same refusal

Failures stay with the adapter being read: a child that dies or stays silent past
`timeout_s` is killed, the read fails with AdapterError (feature "loader_process") and
the next read starts a fresh child. Buffers handed to a failed child go back to the pool
only once it is dead. Children start on first use, at most `processes` of them; they
exit with the engine (loader_process.py watches its parent).
"""
from __future__ import annotations

import os
import threading
import time

from loramux_engine.adapters.loader_child import LoaderFailed, LoaderProcess, LoaderSpec
from loramux_engine.adapters.loader_wire import decode_error, rebuild, send
from loramux_engine.lora.host_buffers import HostBufferPool
from loramux_core.errors import AdapterError

__all__ = ["LoaderFailed", "LoaderPool", "LoaderSpec"]


class _Refused(Exception):
    """The child refused the adapter: `error` is the refusal, as an in-process read
    raises it."""

    def __init__(self, error: Exception):
        super().__init__(str(error))
        self.error = error


class LoaderPool:
    """`read(path, version)` -> this rank's LoRAWeights, from a loader process; callable
    from several threads at once (one read per child at a time)."""

    def __init__(self, spec: LoaderSpec, buffers: HostBufferPool, shapes, dtype,
                 processes: int = 2, timeout_s: float = 300.0, start_timeout_s: float = 300.0,
                 fallback=None):
        """`fallback(path, version)`: the in-process read, used from the first time a
        child cannot be started on (the reason is kept in `broken`); None: that fails
        the read."""
        assert buffers.shared and processes >= 1
        self.spec, self.buffers = spec, buffers
        self._shapes, self._dtype = dict(shapes), dtype
        self.processes, self.timeout_s, self.start_timeout_s = processes, timeout_s, \
            start_timeout_s
        self._idle: list[LoaderProcess] = []
        self._all: set[LoaderProcess] = set()
        self._starting = 0
        self._cond = threading.Condition()
        self._closed = False
        self.num_replaced = 0       # children killed after a crash or a hang
        self.fallback = fallback
        self.broken: str | None = None

    def pids(self) -> list[int]:
        with self._cond:
            return sorted(p.pid for p in self._all)

    @property
    def num_idle(self) -> int:
        with self._cond:
            return len(self._idle)

    def read(self, path: str, version: str | None, timeout_s: float | None = None):
        """`timeout_s`: how long the child may take (default: the pool's)."""
        if self.broken is not None and self.fallback is not None:
            return self.fallback(path, version)
        try:
            proc = self._take()
        except (LoaderFailed, OSError) as e:
            self.broken = str(e)
            if self.fallback is None:
                raise AdapterError(f"no adapter loader process could be started: {e}",
                                   feature="loader_process", file=str(path)) from None
            return self.fallback(path, version)
        try:
            weights = self._load(proc, str(path), version,
                                 self.timeout_s if timeout_s is None else timeout_s)
        except LoaderFailed as f:
            self._discard(proc)
            raise AdapterError(f"the adapter could not be read: {f}", feature="loader_process",
                               file=str(path)) from None
        except BaseException:
            (self._give_back if proc.alive else self._discard)(proc)
            raise
        self._give_back(proc)
        return weights

    def _load(self, proc: LoaderProcess, path: str, version: str | None, timeout_s: float):
        """The child's host copy, or its refusal raised; every buffer handed to it goes
        back to the pool once it wrote its last byte (answered, or is dead)."""
        handed: list = []
        try:
            return self._exchange(proc, path, version, time.monotonic() + timeout_s, handed)
        except _Refused as r:
            self._release(handed)
            raise r.error from None
        except OSError as e:  # the socket broke under a send: the child is dying
            self._release(handed, proc)
            raise LoaderFailed(f"its loader process died ({e}; {proc.kill()})") from None
        except BaseException:
            self._release(handed, proc)
            raise

    def _exchange(self, proc: LoaderProcess, path: str, version: str | None,
                  deadline: float, handed: list):
        send(proc.sock, {"op": "load", "path": path, "version": version})
        while True:
            msg, fds = proc.recv(deadline, "finish the read")
            for fd in fds:
                os.close(fd)
            if msg.get("op") == "need":
                # the first buffer of a load is its host copy, later ones lie beside
                # it (engine/adapters/remote_buffers.py with_extras)
                handed.append(self.buffers.acquire(int(msg["nbytes"]), reserve=not handed))
                place = handed[-1].shared
                send(proc.sock, {"op": "buffer", "offset": place.offset,
                                 "nbytes": handed[-1].nbytes}, [place.fd])
            elif msg.get("op") == "done":
                return self._adopt(proc, msg["weights"], handed)
            else:
                raise _Refused(decode_error(msg.get("error", {})))

    def _release(self, handed: list, proc: LoaderProcess | None = None) -> None:
        if proc is not None:
            proc.kill()   # no byte written into a buffer once it is back in the pool
        for buf in handed:
            self.buffers.release(buf)
        handed.clear()

    def _adopt(self, proc: LoaderProcess, desc: dict, handed: list):
        try:
            weights = rebuild(desc, [b.data for b in handed], self._shapes, self._dtype,
                              handed[0] if handed else None)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            proc.kill()
            raise LoaderFailed(f"its loader process answered nonsense ({e})") from None
        for buf in handed:
            self.buffers.attach(weights, buf)
        return weights

    def start(self, up_to: int | None = None) -> None:
        """Start every child now (else each starts on a read that finds none idle), or
        until `up_to` run."""
        limit = self.processes if up_to is None else min(up_to, self.processes)
        started = []
        while True:
            with self._cond:
                if self._closed or len(self._all) + self._starting >= limit:
                    break
            started.append(self._take())
        for proc in started:
            self._give_back(proc)

    def start_in_background(self, up_to: int | None = None) -> threading.Thread:
        """`start(up_to)` on a daemon thread (a child that cannot start now is started, or
        its failure reported, by the first read that needs it)."""
        def run():
            try:
                self.start(up_to)
            except Exception:  # noqa: BLE001 (see above)
                pass
        thread = threading.Thread(target=run, name="adapter-loaders-start", daemon=True)
        thread.start()
        return thread

    def _take(self) -> LoaderProcess:
        """An idle child, or a new one where fewer than `processes` run; waits for one
        to come back otherwise."""
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("the adapter loader pool is closed")
                proc = self._pop_idle()
                if proc is not None:
                    return proc
                if len(self._all) + self._starting < self.processes:
                    break
                self._cond.wait()
            self._starting += 1
        try:
            proc = LoaderProcess(self.spec, self.start_timeout_s)
        finally:
            with self._cond:
                self._starting -= 1
                self._cond.notify_all()
        with self._cond:
            self._all.add(proc)
        return proc

    def _pop_idle(self) -> LoaderProcess | None:
        """An idle child that still runs (under the lock); one that died idle is reaped
        and replaced, not handed out."""
        while self._idle:
            proc = self._idle.pop()
            if proc.alive:
                return proc
            proc.kill()
            self._all.discard(proc)
            self.num_replaced += 1
        return None

    def _give_back(self, proc: LoaderProcess) -> None:
        with self._cond:
            if self._closed:
                proc.kill()
            else:
                self._idle.append(proc)
            self._cond.notify_all()

    def _discard(self, proc: LoaderProcess) -> None:
        proc.kill()
        with self._cond:
            self._all.discard(proc)
            self.num_replaced += 1
            self._cond.notify_all()

    def close(self) -> None:
        """Stop every child (a read in progress fails)."""
        with self._cond:
            self._closed = True
            procs, self._idle = list(self._all), []
            self._all.clear()
            self._cond.notify_all()
        for proc in procs:
            proc.kill()
