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

    WARMUP payload: utf-8 bytes (one per int) of the warm-up rank 0 resolved, as JSON
      (engine/warmup.py WarmupPlan: layers, eager shapes, graph keys): every rank runs
      exactly that list in order, then all agree on the eager steps run (control group)

Slot ops name adapter versions by id (engine/distributed/adapters.py says what each does);
slot is -1 for the ops that concern a host copy only.

Every message is a header int64[3] = (op, payload length, sequence number) followed by
the payload, sent in one broadcast when it is small (see engine/distributed/channel.py).
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import NamedTuple

import torch

OP_STEP, OP_ADD_ADAPTER, OP_SHUTDOWN, OP_WARMUP = 1, 2, 3, 4
SLOT_LOAD, HOST_DROP, RETIRE = 0, 1, 2   # slot op kinds (engine/distributed/adapters.py)
_SAMPLES, _RESET = 1, 2   # per-sequence flags
_GREEDY = 1               # step flags


class SeqPlan(NamedTuple):
    """One scheduled sequence, as the workers need it (a tuple: one per sequence per
    step is built on rank 0 and again on every worker, so it must be cheap)."""
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
        out += op
    for handle, start, num_new, slot, samples, tokens, reset, blocks in plan.seqs:
        out += (handle, start, num_new, slot, samples | reset << 1, len(tokens), len(blocks))
        out += tokens
        out += blocks
    # through an array of machine ints: several times faster than torch.tensor(list)
    return torch.frombuffer(array("q", out), dtype=torch.int64)


def decode_step(payload: torch.Tensor) -> StepPlan:
    v = payload.tolist()
    n_forget, n_ops, n_seqs, step_flags = v[0], v[1], v[2], v[3]
    i = 4 + n_forget
    forget = tuple(v[4:i])
    ops = tuple(tuple(v[i + 3 * k:i + 3 * k + 3]) for k in range(n_ops))
    i += 3 * n_ops
    seqs = []
    for _ in range(n_seqs):
        handle, start, num_new, slot, flags, nt, nb = v[i:i + 7]
        t = i + 7
        i = t + nt + nb
        seqs.append(SeqPlan(handle, start, num_new, slot, bool(flags & _SAMPLES),
                            tuple(v[t:t + nt]), bool(flags & _RESET), tuple(v[t + nt:i])))
    assert i == len(v), f"step plan has {len(v) - i} trailing values"
    return StepPlan(forget, ops, tuple(seqs), bool(step_flags & _GREEDY))


def encode_add_adapter(adapter_id: int, path: str, version: str) -> torch.Tensor:
    return torch.tensor([adapter_id, *f"{version}\0{path}".encode("utf-8")], dtype=torch.int64)


def decode_add_adapter(payload: torch.Tensor) -> tuple[int, str, str]:
    """(adapter id, path, version)."""
    v = payload.tolist()
    version, path = bytes(v[1:]).decode("utf-8").split("\0", 1)
    return v[0], path, version


def encode_text(text: str) -> torch.Tensor:
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.int64)


def decode_text(payload: torch.Tensor) -> str:
    return bytes(payload.tolist()).decode("utf-8")
