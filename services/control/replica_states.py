"""Each engine replica's state as the control plane sees it: starting, warming up,
serving, restarting, failed (AdapterAdmin GetStatus, the `loramux:engine_replica_state`
gauge, transitions in the log).

Learnt from the links: a heartbeat's phase says where a live engine is in its start-up;
"serving" also needs the replay of its adapters and pins to have finished for that engine
process (a restarted replica is not serving what it should before that); no heartbeat for
a while after there were some is "restarting", and for longer than `failed_after_s`
"failed" (whoever supervises the process gave up, or cannot start it)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from loramux.v1 import adapter_admin_pb2 as pb

from loramux_core.v1 import engine_pb2

STATE_NAMES = {pb.REPLICA_STATE_STARTING: "starting", pb.REPLICA_STATE_WARMING_UP: "warming_up",
               pb.REPLICA_STATE_SERVING: "serving", pb.REPLICA_STATE_RESTARTING: "restarting",
               pb.REPLICA_STATE_FAILED: "failed"}
_PHASE = engine_pb2.EnginePhase


@dataclass
class _Seen:
    """What one replica's link told so far."""
    instances: set
    down_since: float | None = None
    state: int = pb.REPLICA_STATE_STARTING
    state_since: float = 0.0


class ReplicaStates:
    def __init__(self, links: list, replayed: Callable[[int], str],
                 failed_after_s: float = 120.0, *,
                 on_change: Callable[[int, str, str, str], None] = lambda *a: None,
                 clock: Callable[[], float] = time.monotonic):
        """`links`: loramux_services.control.engine_link.EngineLink per replica, by index.
        `replayed(replica)`: the engine instance whose replay ended (the table's).
        `on_change(replica, old, new, detail)` is told every transition seen by status()."""
        self.links, self.failed_after_s, self._replayed = links, failed_after_s, replayed
        self._clock, self._on_change = clock, on_change
        now = clock()
        self._seen = [_Seen(set(), state_since=now) for _ in links]

    # ---- what the links and the replay tell ----
    # Each is a transition told at once (a restart can be over before the next status()).
    def up(self, replica: int, instance_id: str) -> None:
        seen = self._seen[replica]
        seen.instances.add(instance_id)
        seen.down_since = None
        self._observe(replica, self._clock())

    def down(self, replica: int) -> None:
        self._seen[replica].down_since = now = self._clock()
        self._observe(replica, now)

    # ---- what they add up to ----
    def _now_state(self, replica: int, now: float) -> tuple[int, str]:
        link, seen = self.links[replica], self._seen[replica]
        if not link.up:
            if seen.down_since is None:
                return pb.REPLICA_STATE_STARTING, "no heartbeat yet"
            silent = now - seen.down_since
            state = (pb.REPLICA_STATE_FAILED if silent > self.failed_after_s
                     else pb.REPLICA_STATE_RESTARTING)
            return state, f"no heartbeat for {silent:.0f} s"
        hb = link.conn.heartbeat
        if hb.phase == _PHASE.ENGINE_PHASE_LOADING:
            return pb.REPLICA_STATE_STARTING, hb.phase_detail or "loading"
        if hb.phase == _PHASE.ENGINE_PHASE_WARMING_UP:
            return pb.REPLICA_STATE_WARMING_UP, hb.phase_detail or "warming up"
        if self._replayed(replica) != hb.instance_id:
            return pb.REPLICA_STATE_STARTING, "replaying its adapters and pins"
        return pb.REPLICA_STATE_SERVING, ""

    def _observe(self, replica: int, now: float) -> tuple[int, str]:
        seen = self._seen[replica]
        state, detail = self._now_state(replica, now)
        if state != seen.state:
            self._on_change(replica, STATE_NAMES[seen.state], STATE_NAMES[state], detail)
            seen.state, seen.state_since = state, now
        return state, detail

    def status(self) -> list[pb.ReplicaStatus]:
        """Every replica's status now (and the transitions since the last call told)."""
        now = self._clock()
        out = []
        for index, (link, seen) in enumerate(zip(self.links, self._seen)):
            state, detail = self._observe(index, now)
            hb = link.conn.heartbeat
            live = link.up
            out.append(pb.ReplicaStatus(
                replica=index, state=state, detail=detail,
                progress=hb.phase_progress if live else 0.0,
                eta_s=hb.phase_eta_s if live else -1.0, since_s=now - seen.state_since,
                instance_id=hb.instance_id if live else "",
                restarts=max(0, len(seen.instances) - 1),
                in_flight_requests=hb.in_flight_requests if live else 0))
        return out
