"""An adapter loader process: reads, checks and converts adapters for one engine rank,
writing each host copy straight into a shared buffer of the engine's
(engine/adapters/loader_pool.py starts it; engine/adapters/loader_wire.py is the wire).

It runs the very code an in-process read runs (engine/lora/weights.py load_lora: files
opened inside the adapter roots through loramux_core/safe_files.py, hashed, checked,
converted), so a refusal is the same error with the same message. It holds a buffer of
the engine's only for the load that writes it, and exits when the engine goes: at the
end of its socket, or when its parent changes (the engine was killed while this process
was stuck in a read).

    python -m loramux_engine.adapters.loader_process <socket fd> <engine pid>
"""
from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

PARENT_POLL_S = 0.2


def main(fd: int, parent: int) -> None:
    _exit_with_parent(parent)
    # a Ctrl-C reaches the whole process group: the engine decides when this one ends
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import socket

    from loramux_core.open_audit import install_from_env
    install_from_env("adapter-loader")
    sock = socket.socket(fileno=fd)
    from loramux_engine.adapters.loader_wire import LoaderGone, recv, send
    try:
        init, _ = recv(sock)
        _lower_priority(int(init.get("niceness", 0)))  # before torch's import, too
        read, scratch = _reader(init)
        send(sock, {"op": "ready"})
        while True:
            msg, _ = recv(sock)
            _serve(sock, read, scratch, msg)
    except (LoaderGone, OSError):  # the engine closed the socket, or is gone
        pass


def _exit_with_parent(parent: int) -> None:
    """A daemon thread ends this process when `parent` is no longer its parent (the
    engine died, even by SIGKILL): at once through a pidfd, else within PARENT_POLL_S."""
    def watch():
        try:
            pidfd = os.pidfd_open(parent)
        except (AttributeError, OSError):
            pidfd = None
        if pidfd is not None and os.getppid() == parent:
            select.select([pidfd], [], [])
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(0)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _lower_priority(niceness: int) -> None:
    """Run `niceness` steps below the engine (where the system refuses, as it is)."""
    if niceness > 0:
        try:
            os.nice(niceness)
        except OSError:
            pass


def _reader(init: dict):
    """(path, version, buffers) -> LoRAWeights, as the engine's in-process reader; and
    the pool files are read into."""
    import torch

    from loramux_engine.lora.base_copies import BaseLayers
    from loramux_engine.lora.host_buffers import HostBufferPool
    from loramux_engine.lora.weights import load_lora
    from loramux_engine.parallel import TPGroup
    from loramux_core.adapter.plan import PlanCache
    from loramux_core.model.hf_config import ModelConfig
    from loramux_core.safe_files import AdapterRoots

    torch.set_num_threads(1)
    mc = ModelConfig.from_dir(init["model"])
    roots = AdapterRoots(init["roots"]) if init["roots"] else None
    tp, dtype = TPGroup(init["tp_rank"], init["tp_size"]), getattr(torch, init["dtype"])
    plans = PlanCache()
    base = BaseLayers(init["model"], mc.tie_word_embeddings)

    def read(path: str, version: str | None, buffers):
        return load_lora(path, mc, init["max_lora_rank"], tp=tp, dtype=dtype, roots=roots,
                         expected_version=version, buffers=buffers, plan_cache=plans,
                         base_layers=base)
    return read, HostBufferPool().scratch


def _serve(sock, read, scratch, msg: dict) -> None:
    """One load: the host copy written into the engine's buffers, then `done` (or the
    refusal as `error`); every buffer is unmapped before the answer goes."""
    from loramux_engine.adapters.loader_wire import describe, encode_error, send
    from loramux_engine.adapters.remote_buffers import RemoteBuffers

    buffers = RemoteBuffers(sock, scratch)
    try:
        weights = read(msg["path"], msg.get("version"), buffers)
        weights = buffers.with_extras(weights)
        answer = {"op": "done", "weights": describe(weights, buffers.bases)}
        del weights
    except Exception as exc:  # the refusal goes to the engine, which raises it
        answer = {"op": "error", "error": encode_error(exc)}
    buffers.close()
    send(sock, answer)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
