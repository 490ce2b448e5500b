"""A dead rank takes a tensor-parallel engine down cleanly: a killed worker makes rank 0
raise EngineDeadError promptly (no hang) and leaves no process behind; a killed rank 0
makes its workers exit; close() joins the workers; two engines in one process each get
their own ephemeral rendezvous port (side by side on the CPU; one after the other on CUDA,
where NCCL's default group is process-wide)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import logging
import multiprocessing
import textwrap
import time
from pathlib import Path

import pytest

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_engine.distributed import fast_allreduce
from loramux_core.errors import InvalidRequestError
from tests.conftest import TEST_DEVICE, placed
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


def in_own_process_on_cuda(fn, *args, timeout_s: float = 180.0, ranks: int = 2) -> None:
    """fn(*args) here on the CPU; on CUDA in a spawned process that leaves by os._exit.
    A CUDA process that lost a tensor-parallel rank keeps NCCL's default group (its
    teardown may wait for the lost peer), so it starts no other TP engine and its
    interpreter exit may not return: the engine server exits by os._exit then too
    (engine/server/main.py). `fn` raises on failure; its traceback is in the output.
    The spawned process is outside conftest's Engine patch, which skips a TP engine
    wanting more GPUs than there are, so the same skip is here (`ranks`)."""
    if TEST_DEVICE == "cpu":
        fn(*args)
        return
    import torch
    if torch.cuda.device_count() < ranks:
        pytest.skip(f"tensor parallelism over {ranks} ranks needs as many GPUs")
    proc = multiprocessing.get_context("spawn").Process(target=_run_and_exit, args=(fn, args))
    proc.start()
    proc.join(timeout_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5)
        pytest.fail(f"{fn.__name__} did not finish within {timeout_s:.0f} s")
    assert proc.exitcode == 0, f"{fn.__name__} failed (traceback above)"


def _run_and_exit(fn, args) -> None:
    import traceback
    code = 0
    try:
        fn(*args)
    except BaseException:  # noqa: BLE001 - reported by the exit status
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _killed_worker_sync(model_dir: str) -> None:
    engine = Engine(placed(EngineConfig(model=model_dir, tp_size=2, num_kv_blocks=64),
                           TEST_DEVICE))
    try:
        pids = engine.executor.pids
        engine.add_request("r", [5, 6, 7, 8], LONG)
        engine.step()
        engine.step()
        kill_rank_and_expect_dead(engine, pids[0])
    finally:
        engine.close()
    assert wait_gone(pids, 30)


def test_killed_worker_raises_promptly_and_cleans_up(llama_family):
    in_own_process_on_cuda(_killed_worker_sync, str(llama_family.model_dir))


def test_close_joins_workers_and_engines_do_not_collide(llama_family, caplog):
    """On the CPU two engines run side by side (free-standing gloo groups). On CUDA a
    second engine while the first runs is refused at once, before any worker starts (NCCL
    goes through the process's one default group); the next one after close() starts and
    gives the same tokens. Symmetric memory is set up once per process: an engine after
    the first in rank 0's process takes NCCL at once, named in the log, instead of
    waiting out a rendezvous its new workers cannot answer (engine/distributed/
    fast_allreduce.py)."""
    cfg = EngineConfig(model=str(llama_family.model_dir), tp_size=2, num_kv_blocks=64)
    prompt = [[9, 10, 11]]
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    if TEST_DEVICE == "cpu":
        with Engine(cfg) as a, Engine(cfg) as b:
            pids = a.executor.pids + b.executor.pids
            outs = [e.generate(prompt, greedy) for e in (a, b)]
    else:
        with caplog.at_level(logging.WARNING, logger="loramux_engine.distributed.fast_allreduce"):
            with Engine(cfg) as a:
                children = {p.pid for p in multiprocessing.active_children()}
                with pytest.raises(InvalidRequestError, match="already running in this process"):
                    Engine(cfg)
                assert {p.pid for p in multiprocessing.active_children()} \
                    == children, "the refused engine started workers"
                outs = [a.generate(prompt, greedy)]
                pids = a.executor.pids
            entered = fast_allreduce._rendezvous_entered   # by `a` or an earlier test's engine
            caplog.clear()
            with Engine(cfg) as b:
                outs.append(b.generate(prompt, greedy))
                pids += b.executor.pids
                assert b.executor.tp.reducer is None
        if entered:
            assert "set up by an earlier engine of this process" in caplog.text
    assert outs[0][0].token_ids == outs[1][0].token_ids
    assert all(gone(p) for p in pids)


def test_workers_exit_when_rank0_dies(llama_family, tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, sys
        from loramux_engine import Engine, EngineConfig
        if __name__ == "__main__":
            e = Engine(EngineConfig(model={str(llama_family.model_dir)!r}, tp_size=2,
                                    device="cpu", num_kv_blocks=64))
            print(*e.executor.pids, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    path = tmp_path / "rank0.py"
    path.write_text(script)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), str(ROOT)]))}
    proc = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 1
    assert wait_gone(pids, 30), "a worker outlived rank 0"


def _killed_worker_async(model_dir: str) -> None:
    engine = Engine(placed(EngineConfig(model=model_dir, tp_size=2, num_kv_blocks=64,
                                        async_scheduling=True), TEST_DEVICE))
    pids = engine.executor.pids
    try:
        engine.add_request("r", [5, 6, 7, 8], SamplingParams(
            max_tokens=200, temperature=0.0, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert engine._inflight is not None, "async: a step is in flight"
        kill_rank_and_expect_dead(engine, pids[0])
    finally:
        engine.close()
    assert engine._inflight is None
    assert wait_gone(pids, 30)


def test_killed_worker_mid_async_run_raises_and_close_is_clean(llama_family):
    """A step in flight when a worker dies: the next step raises EngineDeadError promptly
    (no hang), it stays dead, and close() drops the step in flight without raising. On
    CUDA rank 0's all-reduce of that step waits for the lost peer until close() aborts the
    communicator, so close() must not wait for the device first (Engine.close)."""
    in_own_process_on_cuda(_killed_worker_async, str(llama_family.model_dir))
