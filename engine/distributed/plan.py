"""The step plan: what rank 0 tells the other tensor-parallel ranks, as one int64 tensor.

Workers keep a mirror of every request rank 0 has scheduled (engine/distributed/mirror.py),
so a plan carries only what changed since the last one:

    STEP payload (all int64, no pickle):
      n_forget, n_slot_ops, n_seqs, step flags (bit0 greedy: see below),
      forget handles                      n_forget x 1   requests that finished
      slot ops (kind, slot, adapter id)   n_slot_ops x 3 LOAD / DROP / RETIRE, in engine order
      per sequence, in batch order:
        handle, start, num_new, slot, flags (bit0 samples, bit1 reset blocks),
        n_tokens, n_blocks, tokens[n_tokens], blocks[n_blocks]

`tokens` are the request's token ids the workers have not seen yet (the whole prompt the
first time, afterwards the token(s) rank 0 sampled since); `blocks` are the block ids
appended to the request's block table, or its whole table when bit1 says the table was
rebuilt (preemption and resume, or a fresh start). A request is known by a `handle`, a
small integer rank 0 assigns once.

`greedy` is rank 0's decision that this step takes the greedy pick
(ModelRunner.takes_greedy_pick): a decode step that replays a CUDA graph then replays
the greedy graph (lm_head, the vocabulary all-gather and the pick inside it) on every
rank, so every rank captures and replays the same graph with the same collectives;
workers just do not read its output. An eager step takes the pick after its forward
pass on every rank alike.

    ADD_ADAPTER payload: adapter id, utf-8 bytes of the adapter directory (one per int)

Slot ops name adapter versions by id (engine/distributed/adapters.py says what each does);
slot is -1 for the ops that concern a host copy only.

Every message is a header int64[3] = (op, payload length, sequence number) followed by
the payload, sent in one broadcast when it is small (see engine/distributed/channel.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

OP_STEP, OP_ADD_ADAPTER, OP_SHUTDOWN = 1, 2, 3
SLOT_LOAD, HOST_DROP, RETIRE = 0, 1, 2   # slot op kinds (engine/distributed/adapters.py)
_SAMPLES, _RESET = 1, 2   # per-sequence flags
_GREEDY = 1               # step flags


@dataclass(frozen=True)
class SeqPlan:
    """One scheduled sequence, as the workers need it."""
    handle: int
    start: int
    num_new: int
    slot: int
    samples: bool
    new_tokens: tuple[int, ...]
    reset_blocks: bool
    new_blocks: tuple[int, ...]


@dataclass(frozen=True)
class StepPlan:
    forget: tuple[int, ...] = ()
    slot_ops: tuple[tuple[int, int, int], ...] = ()   # (kind, slot, adapter id)
    seqs: tuple[SeqPlan, ...] = ()
    greedy: bool = False    # the step takes the greedy pick (in the graph on CUDA)


def encode_step(plan: StepPlan) -> torch.Tensor:
    out = [len(plan.forget), len(plan.slot_ops), len(plan.seqs),
           _GREEDY if plan.greedy else 0, *plan.forget]
    for op in plan.slot_ops:
        out.extend(op)
    for s in plan.seqs:
        flags = (_SAMPLES if s.samples else 0) | (_RESET if s.reset_blocks else 0)
        out.extend((s.handle, s.start, s.num_new, s.slot, flags, len(s.new_tokens),
                    len(s.new_blocks)))
        out.extend(s.new_tokens)
        out.extend(s.new_blocks)
    return torch.tensor(out, dtype=torch.int64)


def decode_step(payload: torch.Tensor) -> StepPlan:
    v = payload.tolist()
    n_forget, n_ops, n_seqs, step_flags = v[0], v[1], v[2], v[3]
    i = 4
    forget = tuple(v[i:i + n_forget])
    i += n_forget
    ops = tuple(tuple(v[i + 3 * k:i + 3 * k + 3]) for k in range(n_ops))
    i += 3 * n_ops
    seqs = []
    for _ in range(n_seqs):
        handle, start, num_new, slot, flags, nt, nb = v[i:i + 7]
        i += 7
        tokens = tuple(v[i:i + nt])
        i += nt
        blocks = tuple(v[i:i + nb])
        i += nb
        seqs.append(SeqPlan(handle, start, num_new, slot, bool(flags & _SAMPLES), tokens,
                            bool(flags & _RESET), blocks))
    assert i == len(v), f"step plan has {len(v) - i} trailing values"
    return StepPlan(forget, ops, tuple(seqs), bool(step_flags & _GREEDY))


def encode_add_adapter(adapter_id: int, path: str, version: str) -> torch.Tensor:
    return torch.tensor([adapter_id, *f"{version}\0{path}".encode("utf-8")], dtype=torch.int64)


def decode_add_adapter(payload: torch.Tensor) -> tuple[int, str, str]:
    """(adapter id, path, version)."""
    v = payload.tolist()
    version, path = bytes(v[1:]).decode("utf-8").split("\0", 1)
    return v[0], path, version
