"""A dead rank takes a tensor-parallel engine down cleanly: a killed worker makes rank 0
raise EngineDeadError promptly (no hang) and leaves no process behind; a killed rank 0
makes its workers exit; close() joins the workers; two engines in one process each get
their own ephemeral rendezvous port."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from engine import Engine, EngineConfig, SamplingParams
from tests.support.ranks import kill_rank_and_expect_dead

ROOT = Path(__file__).resolve().parents[1]
LONG = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its reaper counts as exited)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return True
    return state in ("Z", "X")


def wait_gone(pids, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.05)
    return False


def test_killed_worker_raises_promptly_and_cleans_up(llama_family):
    engine = Engine(EngineConfig(model=str(llama_family.model_dir), tp_size=2, num_kv_blocks=64))
    try:
        pids = engine.executor.pids
        engine.add_request("r", [5, 6, 7, 8], LONG)
        engine.step()
        engine.step()
        kill_rank_and_expect_dead(engine, pids[0])
    finally:
        engine.close()
    assert wait_gone(pids, 30)


def test_close_joins_workers_and_engines_do_not_collide(llama_family):
    cfg = EngineConfig(model=str(llama_family.model_dir), tp_size=2, num_kv_blocks=64)
    with Engine(cfg) as a, Engine(cfg) as b:
        pids = a.executor.pids + b.executor.pids
        outs = [e.generate([[9, 10, 11]], SamplingParams(max_tokens=4, temperature=0.0))
                for e in (a, b)]
        assert outs[0][0].token_ids == outs[1][0].token_ids
    assert all(gone(p) for p in pids)


def test_workers_exit_when_rank0_dies(llama_family, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from engine import Engine, EngineConfig
        if __name__ == "__main__":
            e = Engine(EngineConfig(model={str(llama_family.model_dir)!r}, tp_size=2,
                                    device="cpu", num_kv_blocks=64))
            print(*e.executor.pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = tmp_path / "rank0.py"
    path.write_text(script)
    sdk = ROOT / "clients" / "python"   # the SDK, where it is not installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(sdk)])}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert wait_gone(pids, 30), "a worker outlived rank 0"
