"""What the engines say of their start-up, on `loramux serve`'s stderr while it waits.

Each engine process writes its start-up progress to its own log (engine/startup.py
ProgressLine: `engine warm-up: capturing decode graph 30/56, 54% of warm-up, about 21 s
left`, and the warm-up's report); a user who ran `loramux serve` watches the terminal, not
the work dir. So until the service serves, those lines of every engine log are echoed
there, each under its process's name (`engine-1: engine warm-up: ...`)."""
from __future__ import annotations

import re
import sys
import threading
from pathlib import Path
from typing import TextIO

PROGRESS = re.compile(r"^engine (loading|warm-up|parallel compile)\b")


class StartProgress:
    """Echoes the progress lines appended to `logs` ({name: path}) from their current
    ends, every `period_s`, until stop()."""

    def __init__(self, logs: dict[str, Path], stream: TextIO | None = None,
                 period_s: float = 0.5):
        self._stream = stream or sys.stderr
        self._period_s = period_s
        self._offsets = {name: (path, path.stat().st_size if path.exists() else 0)
                         for name, path in logs.items()}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="start-progress", daemon=True)

    def __enter__(self) -> "StartProgress":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self._echo()  # what came in the last period

    def _run(self) -> None:
        while not self._done.wait(self._period_s):
            self._echo()

    def _echo(self) -> None:
        for name, (path, offset) in list(self._offsets.items()):
            if not path.exists():
                continue
            if path.stat().st_size < offset:   # a new file in its place
                offset = 0
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
            whole = data[:data.rfind(b"\n") + 1]   # a line still being written waits
            self._offsets[name] = (path, offset + len(whole))
            for line in whole.decode(errors="replace").splitlines():
                if PROGRESS.match(line):
                    print(f"{name}: {line}", file=self._stream, flush=True)
