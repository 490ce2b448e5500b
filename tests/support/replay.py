"""An engine and a control plane as real processes (services/launcher.py Cluster), and
what the control plane's replay left the engine holding: for tests of what a restart
replays from the SQLite registry."""
from __future__ import annotations

import time
from pathlib import Path

from loramux_services.launcher import Cluster, ClusterConfig, wait_serving


def start_engine_and_control(model: Path, adapters: Path, workdir: Path) -> Cluster:
    c = Cluster(ClusterConfig(model=str(model), adapter_roots=(str(adapters),),
                              workdir=str(workdir), env={"OMP_NUM_THREADS": "1"}))
    for name in ("engine", "control"):  # this start's logs only
        (workdir / f"{name}.log").unlink(missing_ok=True)
    c.start("engine", "control")
    c.wait_ready("engine", "control")
    wait_serving(c.control_address)
    return c


def replayed(c: Cluster, timeout_s: float = 30.0) -> set[str]:
    """Adapters the engine holds once the control plane has replayed to it."""
    deadline = time.monotonic() + timeout_s
    while '"replayed"' not in c.log_tail("control", 100_000):
        assert time.monotonic() < deadline, c.log_tail("control")
        time.sleep(0.1)
    ev = c.wait_output(lambda m: m.WhichOneof("kind") == "event", 30)
    return {a.name for a in ev.event.adapters}
