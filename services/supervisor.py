"""Keeps `loramux serve`'s processes alive: a dead engine replica, gateway or control plane
starts again on the same addresses after a backoff (the control plane replays adapters
and pins to a restarted replica; the gateway routes around a replica until it serves), and
a process that keeps dying (a crash loop) stops the service with one line naming it and
its log instead of restarting it forever.

The supervisor only decides; the Cluster (services/launcher.py) starts the processes.
`poll()` is called from the launcher's loop every few hundred milliseconds and never waits,
so a stop signal is seen at once and nothing is restarted once a stop was requested."""
from __future__ import annotations

import signal
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead process starts again, and when dying is a crash loop."""
    backoff_s: float = 0.5          # the first restart's wait, doubled on each death ...
    max_backoff_s: float = 10.0     # ... up to this
    healthy_s: float = 60.0         # running this long since its start resets the backoff
    crash_loop_deaths: int = 5      # this many deaths of one process ...
    crash_loop_window_s: float = 300.0  # ... within this many seconds stop the service

    def backoff(self, attempt: int) -> float:
        """The wait before restart number `attempt` (1, 2, ...) since the last healthy run."""
        return min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1))


class CrashLoop(Exception):
    """A process died `crash_loop_deaths` times within the window: str() is the one line."""

    def __init__(self, name: str, deaths: int, window_s: float, log: str):
        super().__init__(f"{name} died {deaths} times within {window_s:g} s (a crash loop); "
                         f"stopping. Its log: {log}")
        self.name, self.log = name, log


def describe_exit(returncode: int) -> str:
    """'exited with status 3' or 'was killed by SIGKILL'."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


@dataclass
class _Life:
    """One supervised process's history."""
    started_at: float
    attempt: int = 0                      # restarts since its last healthy run
    restart_at: float | None = None       # when a dead one starts again
    deaths: deque = field(default_factory=deque)


class Supervisor:
    """Watches every process of `cluster` (a loramux_services.launcher.Cluster) once it serves."""

    def __init__(self, cluster, policy: RestartPolicy = RestartPolicy(), *,
                 say: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.cluster, self.policy, self._clock = cluster, policy, clock
        self._say = say or (lambda line: print(f"loramux: {line}", file=sys.stderr, flush=True))
        now = clock()
        self._lives = {name: _Life(started_at=now) for name in cluster.services}
        self._ready_seen = {name: True for name in cluster.services}
        self.restarts = 0

    def poll(self) -> None:
        """Note deaths, restart what is due, say transitions; raise CrashLoop."""
        now = self._clock()
        for name in self.cluster.services:
            life = self._lives[name]
            proc = self.cluster.procs.get(name)
            if life.restart_at is not None:
                if now >= life.restart_at:
                    self._restart(name, life, now)
            elif proc is not None and proc.poll() is not None:
                self._died(name, life, proc.returncode, now)
            elif not self._ready_seen[name] and self.cluster.is_ready(name):
                self._ready_seen[name] = True
                replay = ("; the control plane replays its adapters before it takes them"
                          if name in self.cluster.engine_names else "")
                self._say(f"{name}: up again (attempt {life.attempt}){replay}")

    def _died(self, name: str, life: _Life, returncode: int, now: float) -> None:
        p = self.policy
        if now - life.started_at >= p.healthy_s:
            life.attempt = 0
        life.deaths.append(now)
        while life.deaths and now - life.deaths[0] > p.crash_loop_window_s:
            life.deaths.popleft()
        log = str(self.cluster.log_path(name))
        if len(life.deaths) >= p.crash_loop_deaths:
            self._say(f"{name}: failed ({describe_exit(returncode)})")
            raise CrashLoop(name, len(life.deaths), p.crash_loop_window_s, log)
        life.attempt += 1
        wait = p.backoff(life.attempt)
        life.restart_at = now + wait
        self.cluster.procs.pop(name, None)
        self._say(f"{name} {describe_exit(returncode)}; restarting it in {wait:g} s "
                  f"(attempt {life.attempt}, log {log})")

    def _restart(self, name: str, life: _Life, now: float) -> None:
        life.restart_at, life.started_at = None, now
        self._ready_seen[name] = False
        self.cluster.start(name)
        self.restarts += 1
        self._say(f"{name}: starting (attempt {life.attempt})")
