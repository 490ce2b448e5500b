"""A loader process's view of the engine's host buffers, for one load: what
engine/lora/weights.py asks of a HostBufferPool (`acquire`, `release`, `attach`,
`scratch`), where `acquire` asks the engine for a shared buffer and maps it here
(engine/adapters/loader_wire.py). The engine owns every buffer: it takes back those of
a refused load itself, so `release` and `attach` do nothing here. Files are read into
`scratch`, this process's own reused memory.
"""
from __future__ import annotations

import dataclasses
import gc
import os
from types import MappingProxyType

import torch

from loramux_engine.adapters.loader_wire import recv, send
from loramux_engine.lora.host_buffers import HostBuffer, HostBufferPool
from loramux_engine.lora.shared_memory import map_place

_ALIGN = 256


class RemoteBuffers:
    def __init__(self, sock, scratch: HostBufferPool):
        self._sock = sock
        self.scratch = scratch
        self.bases: list[torch.Tensor] = []   # the buffers of this load, in order
        self._maps: list = []

    def acquire(self, nbytes: int) -> HostBuffer:
        send(self._sock, {"op": "need", "nbytes": int(nbytes)})
        msg, fds = recv(self._sock)
        assert msg["op"] == "buffer", msg  # the engine's only answer (loader_pool.py)
        try:
            m, view = map_place(fds[0], msg["offset"], msg["nbytes"])
        finally:
            for fd in fds:
                os.close(fd)
        self._maps.append(m)
        self.bases.append(view[:msg["nbytes"]])
        return HostBuffer(self.bases[-1], msg["nbytes"], None)

    def release(self, buf: HostBuffer) -> None:
        pass

    def attach(self, owner, buf: HostBuffer) -> None:
        pass

    def with_extras(self, weights):
        """`weights` with its end and expert factors (separate tensors) moved into one
        more shared buffer, so every tensor of it lies in the engine's buffers."""
        tensors = [t for ab in (*weights.ends.values(), *weights.experts.values()) for t in ab]
        if not tensors:
            return weights
        sizes = [-(-t.nbytes // _ALIGN) * _ALIGN for t in tensors]
        buf = self.acquire(max(sum(sizes), _ALIGN))
        moved, at = {}, 0
        for t, size in zip(tensors, sizes):
            dst = buf.data[at:at + t.nbytes].view(t.dtype).view(t.shape)
            moved[id(t)] = dst.copy_(t)
            at += size
        return dataclasses.replace(
            weights,
            ends=MappingProxyType({k: (moved[id(a)], moved[id(b)])
                                   for k, (a, b) in weights.ends.items()}),
            experts=MappingProxyType({k: (moved[id(a)], moved[id(b)])
                                      for k, (a, b) in weights.experts.items()}))

    def close(self) -> None:
        """Unmap every buffer of this load (nothing here may view them afterwards)."""
        self.bases.clear()
        for m in self._maps:
            try:
                m.close()
            except BufferError:  # a view lives on in a reference cycle (a traceback)
                gc.collect()
                try:
                    m.close()
                except BufferError:  # unmapped when the last view goes
                    pass
        self._maps.clear()
