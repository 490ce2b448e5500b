"""One adapter loader process as the engine sees it: the child
(engine/adapters/loader_process.py, started with the spec of the rank it reads for) and
the engine's end of its socket (engine/adapters/loader_wire.py). The pool that hands
reads to them is engine/adapters/loader_pool.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

from loramux_engine.adapters.loader_wire import LoaderGone, recv, send, socket_pair


@dataclass(frozen=True)
class LoaderSpec:
    """What a loader process needs to read adapters as this rank would."""
    model: str
    max_lora_rank: int
    dtype: str                      # torch dtype name
    roots: tuple[str, ...] = ()     # adapter roots; empty: the path is its own root
    tp_rank: int = 0
    tp_size: int = 1
    # added to the engine's nice value: a loader gets a core only when the step thread and
    # the service's other processes leave one idle (loads are throughput, steps latency)
    niceness: int = 10


class LoaderFailed(Exception):
    """The child died or hung during a read (killed now); the message says which."""


class LoaderProcess:
    """One child and the engine's end of its socket."""

    def __init__(self, spec: LoaderSpec, start_timeout_s: float):
        mine, theirs = socket_pair()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "loramux_engine.adapters.loader_process", str(theirs.fileno()),
             str(os.getpid())],
            pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()
        self.sock = mine
        try:
            send(mine, {"op": "init", **asdict(spec)})
            msg, _ = self.recv(time.monotonic() + start_timeout_s, "start")
        except BaseException:
            self.kill()
            raise
        if msg.get("op") != "ready":
            self.kill()
            raise LoaderFailed(f"the loader process did not start: {msg}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def recv(self, deadline: float, what: str) -> tuple[dict, list[int]]:
        """The child's next message; LoaderFailed (the child killed) when it died or said
        nothing before `deadline`."""
        try:
            self.sock.settimeout(max(deadline - time.monotonic(), 0.001))
            return recv(self.sock)
        except TimeoutError:
            self.kill()
            raise LoaderFailed(f"its loader process did not {what} in time and was "
                               "stopped") from None
        except (LoaderGone, OSError):
            raise LoaderFailed(f"its loader process died ({self.kill()})") from None

    @property
    def alive(self) -> bool:
        return self.sock.fileno() >= 0 and self.proc.poll() is None

    def kill(self) -> str:
        """Stop the child (if it still runs) and reap it; how it ended, in words."""
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        code = self.proc.wait()
        return (f"killed by {signal.Signals(-code).name}" if code < 0
                else f"exit code {code}")
