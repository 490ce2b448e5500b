"""Process groups of one tensor-parallel engine, met through a TCP store on loopback.

Rank 0 opens the store on an ephemeral port the OS picks (`open_store`), so two engines on
one host never collide, and hands the port to the workers it spawns. Every rank then
builds two groups from the store:

- the model group (TPGroup): NCCL on CUDA, gloo on the CPU; carries the layers' all-reduce
  and all-gather. Short timeout: a peer that stops answering mid-forward is an error.
- the control group (gloo, CPU tensors): carries the step plans and small agreements.
  Workers wait on it between steps for as long as the engine is idle, so its timeout is
  long; a dead peer is still seen at once (gloo reports the closed connection), and
  each side also watches the other's process (engine/distributed/watchdog.py).

On the CPU both groups are free-standing gloo groups (not the process-wide default group),
so one process may hold several engines. NCCL goes through the default group, so on CUDA
one process holds one tensor-parallel engine at a time (`check_free`, before any worker
starts); a closed engine leaves the group, and the next one may start.
"""
from __future__ import annotations

import datetime
import logging
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

from loramux_engine.parallel import TPGroup
from loramux_core.errors import InvalidRequestError

_log = logging.getLogger(__name__)

MODEL_TIMEOUT = datetime.timedelta(seconds=60)
CONTROL_TIMEOUT = datetime.timedelta(days=7)
STORE_TIMEOUT = datetime.timedelta(seconds=120)
DISCONNECT_TIMEOUT_S = 10.0
HOST = "127.0.0.1"


@dataclass(frozen=True)
class Groups:
    tp: TPGroup          # model collectives
    control: object      # gloo group for plans (rank 0 broadcasts)


def open_store() -> dist.TCPStore:
    """Rank 0's store on an ephemeral loopback port (`store.port`)."""
    return dist.TCPStore(HOST, 0, None, True, timeout=STORE_TIMEOUT, wait_for_workers=False)


def join_store(port: int) -> dist.TCPStore:
    return dist.TCPStore(HOST, port, None, False, timeout=STORE_TIMEOUT)


def check_free(device: torch.device) -> None:
    """Refuse a second CUDA tensor-parallel engine in this process while one still holds
    the NCCL default group (InvalidRequestError, before any worker is spawned)."""
    if device.type == "cuda" and dist.is_initialized():
        raise InvalidRequestError(
            "a CUDA tensor-parallel engine is already running in this process, or one that "
            "lost a rank could not leave torch.distributed's default group: close the "
            "running one first, or run each engine in a process of its own")


def connect(store, rank: int, size: int, device: torch.device) -> Groups:
    """Build this rank's groups; blocks until every rank has called it."""
    control = dist.ProcessGroupGloo(dist.PrefixStore("control/", store), rank, size,
                                    CONTROL_TIMEOUT)
    if device.type == "cuda":
        check_free(device)
        dist.init_process_group("nccl", store=dist.PrefixStore("model/", store), rank=rank,
                                world_size=size, timeout=MODEL_TIMEOUT)
        return Groups(TPGroup(rank, size, None), control)
    model = dist.ProcessGroupGloo(dist.PrefixStore("model/", store), rank, size, MODEL_TIMEOUT)
    return Groups(TPGroup(rank, size, model), control)


def disconnect(device: torch.device, timeout_s: float = DISCONNECT_TIMEOUT_S) -> None:
    """Leave the NCCL default group (CUDA only; the gloo groups need nothing). Every rank
    calls this at the same time on a clean shutdown. The communicators are aborted, not
    finalised: NCCL's finalising teardown waited past 10 s on two H200s after decode
    graphs had captured its kernels, and a process that still held the group could start
    no other engine. Abort neither waits for peers nor for a dead one, and clears the
    default group. Bounded by a helper thread all the same."""
    if device.type != "cuda" or not dist.is_initialized():
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    _bounded(abort or dist.destroy_process_group, timeout_s)
    if dist.is_initialized():
        _log.warning("the NCCL default group is still held after its teardown (a lost "
                     "peer?): this process can start no other CUDA tensor-parallel engine")


def _bounded(fn, timeout_s: float) -> None:
    done = threading.Event()

    def run():
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - shutting down: report, do not raise
            _log.warning("tensor-parallel teardown failed: %s", exc)
        finally:
            done.set()
    threading.Thread(target=run, name="loramux-tp-teardown", daemon=True).start()
    if not done.wait(timeout_s):
        _log.warning("tensor-parallel teardown did not finish within %.0f s; "
                    "leaving it to process exit", timeout_s)


def agree_min(control, value: int) -> int:
    """The smallest `value` over all ranks (e.g. KV blocks that fit on every device)."""
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=control)
    return int(t.item())

