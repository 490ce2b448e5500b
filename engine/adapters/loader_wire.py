"""What crosses between the engine and an adapter loader process: JSON messages on a
SOCK_SEQPACKET socket pair (one message per packet, shared-memory fds beside them), the
typed error of a refused read, and a host copy as the places of its tensors in the
buffers the engine handed out. No pickle: a loader reads untrusted files, and nothing it
sends can make the engine run code; the engine rebuilds only the error types named here
and only views of its own buffers.

    engine                                 loader process
      load {path, version}        ──▶
                                  ◀──      need {nbytes}            (one per buffer)
      buffer {offset, nbytes} + fd ──▶     writes the host copy into it
                                  ◀──      done {weights}  |  error {error}
"""
from __future__ import annotations

import json
import math
import socket
from types import MappingProxyType

import torch

from loramux_core import errors

MAX_MESSAGE = 1 << 22   # bytes per packet (a host copy's description of a large model)
_BUILTIN = {c.__name__: c for c in (ValueError, TypeError, KeyError, OSError, MemoryError,
                                    RuntimeError, AssertionError)}


class LoaderGone(Exception):
    """The other end closed the socket (the process died or was stopped)."""


def send(sock: socket.socket, msg: dict, fds: list[int] = ()) -> None:
    data = json.dumps(msg).encode()
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def recv(sock: socket.socket) -> tuple[dict, list[int]]:
    """The next message and the fds that came with it; LoaderGone at end of stream. A
    socket timeout raises TimeoutError."""
    data, fds, _flags, _addr = socket.recv_fds(sock, MAX_MESSAGE, 4)
    if not data:
        raise LoaderGone()
    return json.loads(data), fds


def socket_pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (a, b):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MAX_MESSAGE)
    return a, b


# ---- errors -------------------------------------------------------------------------

def encode_error(exc: BaseException) -> dict:
    """A refusal as plain values: its type name and the arguments that rebuild it."""
    out = {"type": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, errors.AdapterError):
        where = f" ({exc.file})" if exc.file else ""
        text = str(exc)
        out.update(message=text[:len(text) - len(where)] if where else text,
                   feature=exc.feature, file=exc.file)
    return out


def decode_error(e: dict) -> Exception:
    """The error `encode_error` described: a loramux_core.errors type or one of a few
    builtin ones by name; anything else as RuntimeError naming the type."""
    name, message = e.get("type", ""), str(e.get("message", ""))
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.AdapterPathError):
        return cls(message)
    if isinstance(cls, type) and issubclass(cls, errors.AdapterChangedError):
        return cls(message, file=e.get("file", ""))
    if isinstance(cls, type) and issubclass(cls, errors.AdapterError):
        return cls(message, feature=e.get("feature", ""), file=e.get("file", ""))
    if isinstance(cls, type) and issubclass(cls, errors.LoramuxError):
        return cls(message)
    if name in _BUILTIN:
        return _BUILTIN[name](message)
    return RuntimeError(f"{name}: {message}")


# ---- a host copy as places in buffers -----------------------------------------------

def place_of(t: torch.Tensor, bases: list[torch.Tensor]) -> list:
    """[buffer index, byte offset, shape, stride] of a view of one of `bases`."""
    ptr = t.data_ptr()
    for i, base in enumerate(bases):
        start = base.data_ptr()
        if start <= ptr and ptr + t.nbytes <= start + base.numel():
            return [i, ptr - start, list(t.shape), list(t.stride())]
    raise AssertionError("a host copy's tensor lies outside its buffers")


def view_at(place: list, bases: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The tensor `place_of` described, as a view of `bases` (bounds checked: a place
    never reaches outside the engine's buffer)."""
    index, offset, shape, stride = place
    base = bases[index]
    itemsize = dtype.itemsize
    last = offset + itemsize * (1 + sum((n - 1) * s for n, s in zip(shape, stride) if n))
    if (offset % itemsize or min(stride, default=0) < 0 or offset < 0
            or (math.prod(shape) and last > base.numel())):
        raise ValueError(f"a loader described a tensor outside its buffer: {place}")
    flat = base[:base.numel() - base.numel() % itemsize].view(dtype)
    return flat.as_strided(shape, stride, flat.storage_offset() + offset // itemsize)


def _is_row(t: torch.Tensor, stacked: torch.Tensor, layer: int) -> bool:
    """`t` is stacked[layer], the very view."""
    row = stacked[layer]
    return (t.data_ptr(), t.shape, t.stride()) == (row.data_ptr(), row.shape, row.stride())


def describe(weights, bases: list[torch.Tensor]) -> dict:
    """A LoRAWeights whose tensors all view `bases`, as plain values. A group's factors
    are the rows `layer` of its stacked tensors (engine/lora/weights.py builds them so):
    named by the layer alone, so the engine makes two views per group by indexing, not
    two checked views of raw places (a few microseconds each, hundreds per adapter, under
    the engine's interpreter lock)."""
    def p(t):
        return None if t is None else place_of(t, bases)
    for (layer, group), g in weights.groups.items():
        a, b = weights.stacked[group]
        assert _is_row(g.a, a, layer) and _is_row(g.b, b, layer), (layer, group)
    return {
        "num_layers": weights.num_layers, "max_rank": weights.max_rank,
        "target_modules": sorted(weights.target_modules), "tp_rank": weights.tp_rank,
        "tp_size": weights.tp_size, "source": weights.source, "version": weights.version,
        "groups": [[layer, group, list(g.slice_ranks), p(g.magnitude)]
                   for (layer, group), g in weights.groups.items()],
        "stacked": {group: [p(a), p(b)] for group, (a, b) in weights.stacked.items()},
        "ends": {m: [p(a), p(b)] for m, (a, b) in weights.ends.items()},
        "experts": [[layer, param, p(a), p(b)]
                    for (layer, param), (a, b) in weights.experts.items()],
    }


def rebuild(d: dict, bases: list[torch.Tensor], shapes, dtype: torch.dtype, buffer):
    """The LoRAWeights `describe` gave, viewing `bases` (`buffer`: the HostBuffer of
    bases[0], the one slot loads copy from); `shapes`: this rank's group shapes."""
    from loramux_engine.lora.weights import LayerGroups, LoRAWeights

    def v(place):
        return None if place is None else view_at(place, bases, dtype)
    stacked = MappingProxyType({g: (v(a), v(b)) for g, (a, b) in d["stacked"].items()})
    ranks, magnitudes = {}, {}
    for layer, group, slice_ranks, m in d["groups"]:
        if not (isinstance(layer, int) and 0 <= layer < len(stacked[group][0])):
            raise ValueError(f"a loader described layer {layer!r} of group {group!r}, "
                             f"which its stacked tensors do not hold")
        ranks[(layer, group)] = tuple(slice_ranks)
        if m is not None:
            magnitudes[(layer, group)] = v(m)
    return LoRAWeights(
        LayerGroups(stacked, ranks, magnitudes), MappingProxyType(shapes), d["num_layers"],
        d["max_rank"],
        frozenset(d["target_modules"]), d["tp_rank"], d["tp_size"], d["source"],
        d["version"], buffer=buffer, stacked=stacked,
        ends=MappingProxyType({m: (v(a), v(b)) for m, (a, b) in d["ends"].items()}),
        experts=MappingProxyType({(layer, param): (v(a), v(b))
                                  for layer, param, a, b in d["experts"]}))

