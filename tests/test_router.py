"""The gateway's replica choice (services/gateway/router.py), the launcher's device sets and
`loramux serve --replicas`, without processes: affinity tiers, load within a tier, spills
from saturated replicas, devices per replica."""
from __future__ import annotations

import pytest
from loramux.v1 import adapter_admin_pb2 as pb

from loramux_services.common.replicas import addresses
from loramux_services.gateway.router import Choice, ReplicaView, choose
from loramux_services.launcher import device_sets

SLOT, HOST, DISK = pb.RESIDENCY_DEVICE, pb.RESIDENCY_HOST, pb.RESIDENCY_DISK


def view(index, residency=None, waiting=0, sent=0, inflight=0):
    return ReplicaView(index, residency or {}, waiting, sent, inflight)


def test_the_best_tier_wins_over_load_within_the_balance_margin():
    replicas = [view(0, {"a": DISK}, inflight=0), view(1, {"a": HOST}, inflight=9),
                view(2, {"a": SLOT}, waiting=3, inflight=10)]
    assert choose(replicas, "a", spill_waiting=4) == Choice(2, "slot")
    assert choose(replicas[:2], "a", spill_waiting=4) == Choice(1, "host")
    assert choose([view(0, {"a": DISK}, waiting=3), view(1, {"a": DISK})], "a",
                  spill_waiting=4) == Choice(1, "cold")


def test_past_the_margin_the_least_loaded_warm_replica_takes_it():
    """More than BALANCE_MIN (4) and BALANCE_SHARE (a quarter) more requests than the least
    loaded replica holding the adapter warm: that one takes the request, at the host tier
    a `balance` decision; a replica that would read it from disk is never that one."""
    assert choose([view(0, {"a": SLOT}, inflight=10), view(1, {"a": HOST}, inflight=5)], "a",
                  spill_waiting=4) == Choice(1, "balance")
    assert choose([view(0, {"a": SLOT}, inflight=9), view(1, {"a": HOST}, inflight=5)], "a",
                  spill_waiting=4) == Choice(0, "slot")        # 4 more: within the margin
    # a quarter of a large load: 130 against 100 balances, 125 against 100 does not
    assert choose([view(0, {"a": SLOT}, inflight=130), view(1, {"a": HOST}, inflight=100)],
                  "a", spill_waiting=4) == Choice(1, "balance")
    assert choose([view(0, {"a": SLOT}, inflight=125), view(1, {"a": HOST}, inflight=100)],
                  "a", spill_waiting=4) == Choice(0, "slot")
    # both in a slot: the tier's name
    assert choose([view(0, {"a": SLOT}, inflight=10), view(1, {"a": SLOT}, inflight=2, sent=9)],
                  "a", spill_waiting=4) == Choice(1, "slot")
    # on disk there: affinity stays (a disk read costs more than the imbalance)
    assert choose([view(0, {"a": SLOT}, inflight=40), view(1, {"a": DISK})], "a",
                  spill_waiting=4) == Choice(0, "slot")
    # the base model is warm everywhere
    assert choose([view(0, inflight=10), view(1, inflight=2, sent=9)], "",
                  spill_waiting=4) == Choice(1, "slot")


def test_a_replica_not_listing_the_adapter_only_when_none_does():
    """A restarted replica (its replay not done) gets no request for an adapter another
    replica lists, even saturated; when none lists it (a load acked a moment ago), any."""
    restarted = view(0, {}, waiting=0)
    assert choose([restarted, view(1, {"a": DISK}, waiting=9)], "a", spill_waiting=4) == Choice(1, "cold")
    assert choose([view(0, {"b": SLOT}), view(1, {"b": SLOT}, inflight=1)], "a",
                  spill_waiting=4) == Choice(0, "cold")


def test_within_a_tier_the_least_waiting_then_the_fewest_inflight():
    replicas = [view(0, {"a": SLOT}, waiting=2), view(1, {"a": SLOT}, waiting=1, sent=2),
                view(2, {"a": SLOT}, waiting=1, inflight=5), view(3, {"a": SLOT}, waiting=1, inflight=4)]
    assert choose(replicas, "a", spill_waiting=10) == Choice(3, "slot")
    # the base model is in every replica's "slot" tier: load alone decides
    assert choose([view(0, waiting=1), view(1)], "", spill_waiting=10) == Choice(1, "slot")


def test_a_saturated_replica_spills_to_an_unsaturated_one():
    hot = [view(0, {"a": SLOT}, waiting=4), view(1, {"a": HOST}, waiting=0)]
    assert choose(hot, "a", spill_waiting=4) == Choice(1, "spill")
    assert choose(hot, "a", spill_waiting=5) == Choice(0, "slot")
    # all saturated: affinity again, not a spill
    both = [view(0, {"a": SLOT}, waiting=9), view(1, {"a": HOST}, waiting=4)]
    assert choose(both, "a", spill_waiting=4) == Choice(0, "slot")


def test_no_live_replica_is_no_choice():
    assert choose([], "a", spill_waiting=4) is None


def test_device_sets_and_addresses():
    assert device_sets(2, 1, None) == ["0", "1"]
    assert device_sets(2, 2, None) == ["0,1", "2,3"]
    assert device_sets(2, 1, "3,5,7") == ["3", "5"]
    with pytest.raises(ValueError, match="need 4 devices"):
        device_sets(2, 2, "0,1")
    assert addresses("tcp://a:1,tcp://b:1", "tcp://a:2, tcp://b:2") == \
        [("tcp://a:1", "tcp://a:2"), ("tcp://b:1", "tcp://b:2")]
    with pytest.raises(ValueError, match="2 replica"):
        addresses("tcp://a:1,tcp://b:1", "tcp://a:2")


def test_serve_replicas_flag(monkeypatch, capsys):
    from loramux_services.serve_args import cluster_config, files, parse_args

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(SystemExit):  # two TP groups of two need four devices
        parse_args(["--replicas", "2", "--tensor-parallel-size", "2", "--device", "cuda"])
    assert "--replicas: 2 replica(s) of 2 device(s) each need 4 devices" in capsys.readouterr().err
    args = parse_args(["--replicas", "2", "--model", "m", "--device", "cpu"])
    cfg = cluster_config(args, files(args))
    assert (cfg.replicas, cfg.tensor_parallel_size) == (2, 1)
