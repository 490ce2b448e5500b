"""Which engine replica takes a request: adapter affinity first, then load.

A replica's tier for an adapter is where that replica holds it: in a GPU slot (no copy
needed), in host memory (a host-to-GPU copy), or only registered (a disk read first). A
replica whose stats do not list the adapter yet (restarted, its replay still loading)
takes requests for it only when no replica lists it (a load acknowledged a moment ago).
The router prefers the best tier and, within a tier, the replica with the least waiting
work.
A replica with `spill_waiting` or more requests waiting to be scheduled is saturated: a
request then goes to an unsaturated replica even at a worse tier (a spill), so one hot
adapter spreads over several replicas instead of queueing on one.

Affinity gives way to balance before saturation too: where the replica affinity picks
carries more than BALANCE_MIN requests, and BALANCE_SHARE more, than the least loaded
replica that holds the adapter warm (in a slot or host memory: at most a host-to-GPU
copy away), the request goes there (`balance`). Without it one replica took every
request whose adapter it happened to hold in a slot while the other idled: two H200s
served 1.57x one's tokens/s, and on the CPU one replica got all 64 requests of the
replicas benchmark. A replica's load is this gateway's requests in flight there plus
those waiting in its latest stats."""
from __future__ import annotations

from dataclasses import dataclass

from loramux.v1 import adapter_admin_pb2 as admin_pb2

SLOT, HOST, COLD, ABSENT = 0, 1, 2, 3
TIER_NAMES = ("slot", "host", "cold", "cold")
SPILL = "spill"
BALANCE = "balance"
DECISIONS = (*TIER_NAMES, SPILL, BALANCE)
BALANCE_MIN = 4        # requests more than the least loaded warm replica, at least ...
BALANCE_SHARE = 0.25   # ... and this share of its load
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
    warm = [r for r in replicas if r.tier(adapter) <= max(HOST, pick.tier(adapter))
            and r.waiting < spill_waiting]
    least = min(warm, key=lambda r: (_load(r), *affinity(r)), default=pick)
    if _load(pick) - _load(least) > max(BALANCE_MIN, BALANCE_SHARE * _load(least)):
        tier = least.tier(adapter)
        return Choice(least.index, BALANCE if tier > pick.tier(adapter) else TIER_NAMES[tier])
    return Choice(pick.index, TIER_NAMES[pick.tier(adapter)])


def _load(r: ReplicaView) -> int:
    return r.inflight + r.waiting
