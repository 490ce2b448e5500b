"""One-shot all-reduce over PyTorch symmetric memory, for the small all-reduces of decode.

A decode step at TP > 1 makes two all-reduces per layer of a [batch, hidden] tensor (8 KB
to 1 MB in bf16). At that size NCCL's ring is all latency. Here every rank allocates, once
at start-up, one symmetric buffer (torch.distributed._symmetric_memory: each rank's buffer
is mapped into every other rank's address space over NVLink) sized for the largest decode
all-reduce, max_num_seqs x hidden. An all-reduce of `t` then is one kernel
(torch.ops.symm_mem.one_shot_all_reduce_copy_out): copy `t` into this rank's buffer,
barrier through the signal pads, read and sum every rank's buffer into `t`, barrier again
(so no rank overwrites its buffer while a peer still reads it). No host sync; it is
captured in CUDA graphs like any kernel. Larger messages (prefill) stay on NCCL.

Never used: NVLink multicast (no multimem ops, no multicast objects).

Selection (`choose`, from EngineConfig.tp_allreduce): one rank: nothing to reduce; the CPU:
gloo; CUDA: "nccl", or "auto"/"symm_mem" = one-shot. Setting it up is collective (local
checks, allocation, rendezvous, then a self-test against NCCL eagerly and one in a captured
CUDA graph) and every step's outcome is agreed over the control group, so all ranks end up
on the same all-reduce: under "auto" any failure on any rank falls back to NCCL everywhere
(logged once, with the reason); under "symm_mem" it is an error.

Once per process: the rendezvous names its store keys by a sequence number that each
process keeps for its whole life (torch's CUDA symmetric memory), and the workers of every
engine are new processes that start it at zero. A second engine of rank 0's process (after
the first was closed) would wait for keys no worker writes, for the store's whole timeout.
So only the first engine of a process that reaches the rendezvous sets one-shot up; a later
one uses NCCL (under "auto", logged) or is refused (under "symm_mem"). The served engine
is one process per engine and never meets this; in-process engines do.
"""
from __future__ import annotations

import dataclasses
import logging
import warnings

import torch
import torch.distributed as dist

from loramux_engine.distributed.group import agree_min
from loramux_core.model.hf_config import ModelConfig
from loramux_core.errors import InvalidRequestError

MODES = ("auto", "nccl", "symm_mem")
MAX_RANKS = 8                    # the kernel is specialised for 2, 4 and 8 ranks
MAX_BUFFER_BYTES = 64 << 20      # above this, the decode all-reduce is not latency-bound
_DTYPES = (torch.bfloat16, torch.float32)   # what the one-shot kernel dispatches on
_ALIGN = 16                      # the kernel's vector width in bytes

_log = logging.getLogger(__name__)

# whether this process has entered a symmetric-memory rendezvous (see "Once per process")
_rendezvous_entered = False


def choose(mode: str, device_type: str, tp_size: int) -> str:
    """"none" (one rank), "gloo" (CPU), "nccl", or "symm_mem" (one-shot; under "auto" it
    may still fall back to NCCL at set-up)."""
    if mode not in MODES:
        raise InvalidRequestError(f"tp_allreduce={mode!r}: must be one of {list(MODES)}")
    if mode == "symm_mem" and device_type != "cuda":
        raise InvalidRequestError(
            f"tp_allreduce='symm_mem' needs device='cuda' (device type {device_type!r}): "
            "symmetric memory exists on CUDA only; use 'auto'")
    if mode == "symm_mem" and tp_size > MAX_RANKS:
        raise InvalidRequestError(
            f"tp_allreduce='symm_mem' supports tp_size <= {MAX_RANKS} (tp_size={tp_size})")
    if tp_size == 1:
        return "none"
    if device_type != "cuda":
        return "gloo"
    if mode == "nccl" or tp_size > MAX_RANKS:
        return "nccl"
    return "symm_mem"


def attach(tp, control, config, device: torch.device):
    """`tp` with a one-shot reducer when `choose` says so and every rank sets it up, else
    `tp` unchanged. Collective: every rank of the engine calls it at the same point."""
    if choose(config.tp_allreduce, device.type, tp.size) != "symm_mem":
        return tp
    hidden = ModelConfig.from_dir(config.model).hidden_size
    reducer, why = OneShotAllReduce.create(tp, control, config.max_num_seqs * hidden,
                                           config.torch_dtype, device)
    if reducer is None:
        if config.tp_allreduce == "symm_mem":
            raise InvalidRequestError(f"tp_allreduce='symm_mem': one-shot all-reduce "
                                      f"unavailable ({why}); use 'auto' or 'nccl'")
        _log.warning("rank %d: tp_allreduce='auto': one-shot all-reduce unavailable (%s); "
                     "using NCCL", tp.rank, why)
        return tp
    return dataclasses.replace(tp, reducer=reducer)


class OneShotAllReduce:
    """Sum over the ranks of tensors up to `numel` elements of `dtype`, in place."""

    def __init__(self, buffer: torch.Tensor, group_name: str):
        self._buf = buffer
        self._group = group_name
        self.numel, self.dtype = buffer.numel(), buffer.dtype
        ops = torch.ops.symm_mem
        self._copy_out = getattr(ops, "one_shot_all_reduce_copy_out", None)  # fused copy-in
        self._out = ops.one_shot_all_reduce_out

    def fits(self, t: torch.Tensor) -> bool:
        """Whether `all_reduce(t)` may run (else the caller uses NCCL): dtype, size, and the
        kernel's 16-byte vectors over `t`'s memory."""
        nbytes = t.numel() * t.element_size()
        return (t.dtype == self.dtype and 0 < t.numel() <= self.numel and t.is_contiguous()
                and t.data_ptr() % _ALIGN == 0 and nbytes % _ALIGN == 0)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks in place (one kernel); returns `t`. Requires fits(t)."""
        buf = self._buf[:t.numel()].view(t.shape)
        if self._copy_out is not None:
            # reads t[i] into this rank's buffer, then writes the sum of every rank's
            # buffer at i into t[i]: same thread, same i, so t may be the output
            self._copy_out(buf, t, "sum", self._group, t)
        else:
            buf.copy_(t)
            self._out(buf, "sum", self._group, t)
        return t

    @classmethod
    def create(cls, tp, control, numel: int, dtype: torch.dtype, device: torch.device
               ) -> tuple["OneShotAllReduce | None", str]:
        """(reducer, "") on every rank, or (None, why) on every rank. Collective over the
        model group (NCCL, the default group) and `control` (gloo): every step's outcome
        is agreed before the next, so no rank enters a rendezvous, a kernel that waits
        for its peers, or a graph replay alone."""
        numel = min(numel, MAX_BUFFER_BYTES // torch.tensor([], dtype=dtype).element_size())
        if device.type == "cuda" and device.index is None and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())  # rank 0's "cuda"
        setup = _SetUp(cls, tp, numel, dtype, device)
        for what, step in setup.steps():
            try:
                why = step()
            except Exception as exc:  # noqa: BLE001 - any failure means: use NCCL
                why = f"{what}: {type(exc).__name__}: {_first_line(exc)}"
            why = _agree(tp, control, why, what)
            if why:
                return None, why
        return setup.reducer, ""


class _SetUp:
    """The steps of OneShotAllReduce.create; each returns "" or why it failed."""

    def __init__(self, cls, tp, numel: int, dtype: torch.dtype, device: torch.device):
        self.cls, self.tp, self.numel, self.dtype, self.device = cls, tp, numel, dtype, device
        self.group = tp.group if tp.group is not None else dist.group.WORLD
        self.buf = self.reducer = self.graph = self.static = None
        self.test = min(numel, 8192) // 8 * 8   # elements of the self-tests

    def steps(self):
        return [("pass the local checks", lambda: _unsupported(self.tp, self.dtype, self.device)),
                ("allocate the symmetric buffer", self.allocate),
                ("map the peers' buffers", self.rendezvous),
                ("match NCCL eagerly", self.eager_test),
                ("capture it in a CUDA graph", self.capture),
                ("match NCCL in a CUDA graph", self.replay_test)]

    def allocate(self) -> str:
        from torch.distributed import _symmetric_memory as symm_mem
        _use_cuda_backend(symm_mem)
        self.buf = symm_mem.empty(self.numel, dtype=self.dtype, device=self.device)
        return ""

    def rendezvous(self) -> str:
        global _rendezvous_entered
        from torch.distributed import _symmetric_memory as symm_mem
        _register_group(symm_mem, self.group.group_name)
        _rendezvous_entered = True   # the sequence moves even if the rendezvous fails
        symm_mem.rendezvous(self.buf, self.group.group_name)
        self.reducer = self.cls(self.buf, self.group.group_name)
        return ""

    def _check(self, x: torch.Tensor, run) -> str:
        """`run()` must leave in x the NCCL sum of x's current values."""
        want = x.clone()
        dist.all_reduce(want, group=self.group)
        run()
        if x.is_cuda:
            torch.cuda.synchronize()
        bad = int((x != want).sum())
        return f"{bad} of {x.numel()} sums differ from NCCL's" if bad else ""

    def _values(self, salt: int) -> torch.Tensor:
        """Small integers (exact sums in bf16 for <= 8 ranks), different per rank."""
        i = torch.arange(self.test, device=self.device)
        return ((i * (salt + 3)) % 7 + self.tp.rank + 1).to(self.dtype)

    def eager_test(self) -> str:
        x = self._values(0)
        why = self._check(x, lambda: self.reducer.all_reduce(x))
        return f"eager self-test: {why}" if why else ""

    def capture(self) -> str:
        # no warm-up run needed: the eager test ran the same kernel at the same size
        self.static = torch.zeros(self.test, dtype=self.dtype, device=self.device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.reducer.all_reduce(self.static)
        return ""

    def replay_test(self) -> str:
        self.static.copy_(self._values(1))
        why = self._check(self.static, self.graph.replay)
        self.graph = self.static = None
        return f"CUDA-graph self-test: {why}" if why else ""


def _unsupported(tp, dtype: torch.dtype, device: torch.device) -> str:
    """Why this rank cannot run the one-shot kernel ("" when it can)."""
    if _rendezvous_entered:
        return ("symmetric memory was set up by an earlier engine of this process (its "
                "rendezvous sequence is process-wide; a new engine's workers start at zero)")
    if device.type != "cuda" or not torch.cuda.is_available():
        return "not a CUDA device"
    if tp.size > MAX_RANKS:
        return f"{tp.size} ranks (at most {MAX_RANKS})"
    if dtype not in _DTYPES:
        return f"dtype {dtype} (the kernel sums bfloat16 and float32 only)"
    if not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_out"):
        return f"torch {torch.__version__} lacks symm_mem.one_shot_all_reduce_out"
    me = device.index if device.index is not None else torch.cuda.current_device()
    peers = [d for d in range(tp.size) if d != me and d < torch.cuda.device_count()]
    blocked = [d for d in peers if not torch.cuda.can_device_access_peer(me, d)]
    return f"no peer access from GPU {me} to GPU(s) {blocked}" if blocked else ""


def _use_cuda_backend(symm_mem) -> None:
    """The CUDA (driver IPC) backend: no NVSHMEM bootstrap, no multicast needed. A process
    that already allocated symmetric memory keeps its backend (set_backend then fails)."""
    try:
        symm_mem.set_backend("CUDA")
    except Exception:  # noqa: BLE001 - already set or allocated: keep what is there
        pass


def _register_group(symm_mem, group_name: str) -> None:
    """Older torch needs the group announced to symmetric memory first; newer torch does
    it by itself (the call is deprecated there and refuses a second registration)."""
    enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
    if enable is None:
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        try:
            enable(group_name)
        except Exception:  # noqa: BLE001 - registered already: the rendezvous will tell
            pass


def _agree(tp, control, why: str, what: str) -> str:
    """Every rank's outcome: "" if all succeeded, else this rank's reason or the name of
    the first rank that failed."""
    first_bad = agree_min(control, tp.rank if why else tp.size)
    if first_bad == tp.size:
        return ""
    return why or f"rank {first_bad} could not {what}"


def _first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else ""
