"""`loramux serve` run as users run it: the real entry point in a process of its own, its
stderr in a file the tests read, the `loramux` command for what an operator would ask."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# the checkout's tests and benchmarks importable in every process it starts (after what
# PYTHONPATH had: a bare checkout's import names, scripts/checkout_path.sh)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(
    filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)])),
       "OMP_NUM_THREADS": "1"}


class ServeProcess:
    def __init__(self, workdir: Path, *argv: str):
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.stderr_path = self.workdir / "serve.stderr"
        with open(self.stderr_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "loramux.cli", "serve", "--workdir", str(self.workdir),
                 *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=ENV)
        self.gateway = self.control = ""

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def wait_serving(self, timeout_s: float = 240.0) -> None:
        """Until serve says it serves; its gateway and control addresses from what it said."""
        deadline = time.monotonic() + timeout_s
        while "loramux serving" not in self.stderr:
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}:\n{self.stderr}"
            assert time.monotonic() < deadline, f"serve not serving:\n{self.stderr}"
            time.sleep(0.2)
        self.gateway = re.search(r"^\s+gateway\s+(\S+)", self.stderr, re.M).group(1)
        self.control = re.search(r"^\s+control\s+(\S+)", self.stderr, re.M).group(1)

    def pid(self, service: str) -> int:
        """The pid of `service` ("engine-1", "gateway", "control") now, from its ready file."""
        return json.loads((self.workdir / f"{service}.ready.json").read_text())["pid"]

    def kill(self, service: str) -> int:
        pid = self.pid(service)
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_ready_again(self, service: str, old_pid: int, timeout_s: float = 180.0) -> int:
        """Until `service` runs again under a new pid (its new ready file); that pid."""
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}:\n{self.stderr}"
            try:
                pid = self.pid(service)
            except (FileNotFoundError, json.JSONDecodeError):
                pid = old_pid
            if pid != old_pid:
                return pid
            assert time.monotonic() < deadline, f"{service} not restarted:\n{self.stderr}"
            time.sleep(0.2)

    def status(self) -> list[dict]:
        """`loramux status --json`: every replica's status as the control plane says it."""
        out = subprocess.run([sys.executable, "-m", "loramux.cli", "status", "--json",
                              "--control", self.control], cwd=ROOT, capture_output=True,
                             text=True, timeout=60, env=ENV)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def states(self) -> list[str]:
        return [r["state"].removeprefix("REPLICA_STATE_").lower() for r in self.status()]

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.send_signal(signal.SIGINT)  # the second one stops at once
                self.proc.wait(30)
        return self.proc.returncode
