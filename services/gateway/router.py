"""Which engine replica takes a request: adapter affinity first, then load.

A replica's tier for an adapter is where that replica holds it: in a GPU slot (no copy
needed), in host memory (a host-to-GPU copy), or only registered (a disk read first). A
replica whose stats do not list the adapter yet (restarted, its replay still loading)
takes requests for it only when no replica lists it (a load acknowledged a moment ago).
The router prefers the best tier and, within a tier, the replica with the least waiting
work.
A replica with `spill_waiting` or more requests waiting to be scheduled is saturated: a
request then goes to an unsaturated replica even at a worse tier (a spill), so one hot
adapter spreads over several replicas instead of queueing on one."""
from __future__ import annotations

from dataclasses import dataclass

from loramux.v1 import adapter_admin_pb2 as admin_pb2

SLOT, HOST, COLD, ABSENT = 0, 1, 2, 3
TIER_NAMES = ("slot", "host", "cold", "cold")
SPILL = "spill"
DECISIONS = (*TIER_NAMES, SPILL)
_TIERS = {admin_pb2.RESIDENCY_DEVICE: SLOT, admin_pb2.RESIDENCY_HOST: HOST}


@dataclass(frozen=True)
class ReplicaView:
    """What the router knows of one live replica at the moment of a decision.

    `residency`: adapter name -> Residency, and `waiting`: requests waiting to be
    scheduled there, both from the replica's latest published stats (at most one stats
    interval old). `sent`: requests this gateway sent there since those stats, not yet
    counted in them. `inflight`: this gateway's live requests there."""
    index: int
    residency: dict
    waiting: int
    sent: int
    inflight: int

    def tier(self, adapter: str) -> int:
        if not adapter:  # the base model is everywhere
            return SLOT
        if adapter not in self.residency:
            return ABSENT
        return _TIERS.get(self.residency[adapter], COLD)


@dataclass(frozen=True)
class Choice:
    replica: int
    decision: str  # one of DECISIONS


def choose(replicas: list[ReplicaView], adapter: str, spill_waiting: int) -> Choice | None:
    """The replica for a request naming `adapter` ("" = base model) among `replicas` (the
    live ones it may run on), or None when there is none."""
    replicas = [r for r in replicas if r.tier(adapter) != ABSENT] or replicas
    if not replicas:
        return None

    def affinity(r: ReplicaView):
        return r.tier(adapter), r.waiting + r.sent, r.inflight, r.index

    best = min(replicas, key=affinity)
    pick = min(replicas, key=lambda r: (r.waiting >= spill_waiting, *affinity(r)))
    if pick.tier(adapter) > best.tier(adapter):
        return Choice(pick.index, SPILL)
    return Choice(pick.index, TIER_NAMES[pick.tier(adapter)])
