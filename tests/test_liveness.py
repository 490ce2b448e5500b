"""Busy is not dead: engine steps far longer than the peers' heartbeat timeout never end
a stream, while a killed or hung engine is still seen as gone within seconds: the
heartbeat timeout, and KILL_MARGIN_S more for a loaded machine's scheduling (its streams
end the gateway's failover wait later: there is no other replica to take them).

Real processes (engine, control plane, gateway) on loopback; the peers' heartbeat
timeout is lowered to 0.5 s so that a step of a few seconds is many timeouts long, and
one test keeps every default through a single 60 s step. Steps are made long for real: a
test hook that sleeps inside every step (or only the N-th), and a long prompt prefilled
in one step on a model big enough to take seconds on the CPU."""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loramux import GenerateClient, LoramuxError
from loramux.v1 import generate_pb2

from loramux_engine import Engine, EngineConfig
from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.support.served import ServedEngine
from tests.support.tiny import TinySpec, make_model

TIMEOUT = 0.5  # the gateway's and control plane's heartbeat timeout here
# a killed engine's streams end within its peers' heartbeat timeout and this: room for a
# loaded machine's stalls (measured: 0.46-0.52 s in all at a 0.5 s timeout, under load)
KILL_MARGIN_S = 3.0
# and the gateway's wait for another replica to take them (none here: one engine)
FAILOVER_WAIT_S = 2.0
# Services on CPU engines whatever LORAMUX_TEST_DEVICE says (steps made long by a prefill
# that takes seconds on the CPU): the served engines and the in-process reference alike
# (tests/conftest.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.engine_device("cpu")]


def start_cluster(root, model, engine_args):
    peers = ("--heartbeat-timeout", str(TIMEOUT))
    c = Cluster(ClusterConfig(model=str(model), adapter_roots=(str(root),),
                              workdir=str(root / "run"), gateway_args=peers, control_args=peers,
                              engine_args=("--device", "cpu", "--heartbeat-interval", "0.1",
                                           *engine_args)))
    c.start()
    try:
        c.wait_ready()
        wait_serving(c.gateway_address)
    except BaseException:
        c.kill_all()
        raise
    return c


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_model(tmp_path_factory.mktemp("liveness") / "model", TinySpec())


@pytest.fixture(scope="module")
def slow_steps(tmp_path_factory, tiny_model):
    """Every engine step sleeps 2 s first (four heartbeat timeouts)."""
    c = start_cluster(tmp_path_factory.mktemp("slow"), tiny_model, ("--debug-step-sleep", "2"))
    yield c
    c.kill_all()


def test_steps_of_four_timeouts_each_do_not_end_a_stream(slow_steps, tiny_model):
    with Engine(EngineConfig(model=str(tiny_model))) as offline:
        want = offline.generate([[5, 6, 7]], _greedy(3))[0].token_ids
    t0 = time.monotonic()
    with GenerateClient(slow_steps.gateway_address) as gen:
        out = gen.generate([5, 6, 7], None, temperature=0.0, max_tokens=3, ignore_eos=True)
    assert out.token_ids == want and out.finish_reason == "length"
    assert time.monotonic() - t0 >= 3 * 2.0  # three steps, each 4x the timeout
    # the start-up line shows the configuration the engine resolved for itself
    assert "device=cpu dtype=float32" in slow_steps.log_tail("engine", 100_000)
    assert "max_loras=4 max_cpu_loras=16" in slow_steps.log_tail("engine", 100_000)


def test_engine_killed_in_a_long_step_is_unavailable_promptly(slow_steps):
    _kill_mid_stream_is_unavailable_within(
        slow_steps, TIMEOUT + FAILOVER_WAIT_S + KILL_MARGIN_S, settle_s=0.5)  # a sleeping step
    with GenerateClient(slow_steps.gateway_address, retry=False) as gen:
        with pytest.raises(LoramuxError) as info:
            gen.generate([5, 6], None, max_tokens=2)
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_a_long_cpu_prefill_does_not_end_the_stream(tmp_path):
    """A 4,000-token prompt prefilled in one step by a 30 M-parameter model."""
    model = make_model(tmp_path / "model", TinySpec(
        hidden_size=512, intermediate_size=2048, num_layers=8, num_heads=8, num_kv_heads=4,
        max_position_embeddings=4096))
    c = start_cluster(tmp_path, model, ("--max-num-batched-tokens", "4096"))
    try:
        prompt = torch.randint(3, 300, (4000,), generator=torch.Generator().manual_seed(0))
        t0 = time.monotonic()
        resps, first = [], None
        with GenerateClient(c.gateway_address) as gen:
            for r in gen.stream(prompt.tolist(), None, temperature=0.0, max_tokens=2,
                                ignore_eos=True):
                first = first or time.monotonic() - t0
                resps.append(r)
        assert sum(len(r.token_ids) for r in resps) == 2
        assert resps[-1].finish_reason, resps[-1]
        # the prefill step itself outlasted several heartbeat timeouts
        assert first > 3 * TIMEOUT, f"prefill took only {first:.2f} s: not a long step"
    finally:
        c.kill_all()


@pytest.mark.timeout(240)
def test_one_60_s_step_with_default_timeouts_ends_no_stream(tmp_path, tiny_model):
    """Every peer at its defaults (heartbeat timeout 1.5 s, interval 0.2 s, stall limit
    600 s) and one engine step that sleeps 60 s while eight streams are in flight: the
    gateway stays SERVING through it, every stream completes with the tokens the offline
    engine gives, and some stream waited the whole step between two of its tokens. Then
    the engine is killed mid-stream: UNAVAILABLE within the default heartbeat timeout,
    the gateway's failover wait and KILL_MARGIN_S."""
    prompts = [[5 + i, 6, 7] for i in range(8)]
    with Engine(EngineConfig(model=str(tiny_model))) as offline:
        want = [o.token_ids for o in offline.generate(prompts, _greedy(6))]
    c = Cluster(ClusterConfig(model=str(tiny_model), adapter_roots=(str(tmp_path),),
                              workdir=str(tmp_path / "run"),
                              engine_args=("--device", "cpu", "--debug-step-sleep", "60",
                                           "--debug-sleep-step", "3")))
    c.start()
    try:
        c.wait_ready()
        wait_serving(c.gateway_address)
        results: list = [None] * len(prompts)

        def stream(i: int) -> None:
            times, tokens, last = [], [], None
            try:
                with GenerateClient(c.gateway_address, retry=False) as gen:
                    for r in gen.stream(prompts[i], None, temperature=0.0, max_tokens=6,
                                        ignore_eos=True):
                        tokens += r.token_ids
                        times += [time.monotonic()] * len(r.token_ids)
                        last = r
                results[i] = (tokens, times, last.finish_reason)
            except LoramuxError as err:
                results[i] = err
        t0 = time.monotonic()
        threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        time.sleep(30)  # inside the long step
        busy = _health(c.gateway_address)
        assert busy == health_pb2.HealthCheckResponse.SERVING  # busy, not dead
        for t in threads:
            t.join(120)
        assert time.monotonic() - t0 >= 60
        assert all(isinstance(r, tuple) for r in results), results
        assert [r[0] for r in results] == want
        assert all(r[2] == generate_pb2.FINISH_REASON_LENGTH for r in results), results
        gaps = [b - a for _, times, _ in results for a, b in zip(times, times[1:])]
        assert max(gaps) >= 55, max(gaps)  # a stream was mid-generation through the step
        assert not c.dead()
        _kill_mid_stream_is_unavailable_within(c, 1.5 + FAILOVER_WAIT_S + KILL_MARGIN_S)
    finally:
        c.kill_all()


def _kill_mid_stream_is_unavailable_within(c, limit_s: float, settle_s: float = 0.0) -> None:
    """A stream is running; `settle_s` after its first token the engine is SIGKILLed: the
    stream ends UNAVAILABLE within `limit_s`."""
    errors: list = []
    first = threading.Event()

    def stream():
        with GenerateClient(c.gateway_address, retry=False) as gen:
            try:
                for _ in gen.stream([5, 6, 7], None, max_tokens=500, ignore_eos=True):
                    first.set()
            except LoramuxError as err:
                errors.append((err, time.monotonic()))
    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(30)
    time.sleep(settle_s)
    t_kill = time.monotonic()
    c.kill("engine")
    t.join(10)
    assert errors, "the stream did not end"
    err, t_end = errors[0]
    assert err.code == grpc.StatusCode.UNAVAILABLE, err
    assert t_end - t_kill < limit_s, t_end - t_kill


def test_a_hung_step_loop_stops_heartbeats_and_they_resume_after(tiny_model):
    """In-process server: heartbeats (every 0.1 s) flow through a 4 s step while the stall
    limit is longer, stop once a step outlasts the limit, and come back when the loop
    moves. The bounds leave 1.4 s for a loaded machine's stalls on either side."""
    with Engine(EngineConfig(model=str(tiny_model))) as eng:
        gaps_busy = _heartbeat_gaps(eng, stall_timeout_s=600.0)
        gaps_hung = _heartbeat_gaps(eng, stall_timeout_s=0.5)
    assert max(gaps_busy) < 1.5, gaps_busy
    assert max(gaps_hung) > 3.0, gaps_hung  # silent from 0.5 s into the 4 s step to its end
    assert gaps_hung[-1] < 1.5, gaps_hung   # beating again after it


def _heartbeat_gaps(eng, stall_timeout_s: float) -> list[float]:
    """Gaps between heartbeats around one request whose single step sleeps 4 s."""
    with ServedEngine(eng, heartbeat_interval_s=0.1, stall_timeout_s=stall_timeout_s,
                      debug_step_sleep_s=4.0) as served:
        served.generate("r", [5, 6], max_tokens=1)
        t_end = time.monotonic() + 6.0
        msgs = served.collect(lambda m: time.monotonic() > t_end, timeout_s=20)
    beats = [t for t, m in msgs if m.WhichOneof("kind") == "heartbeat"]
    return [b - a for a, b in zip(beats, beats[1:])]


def _health(address: str) -> int:
    """The gateway's overall health now (one check, with time to answer on a loaded machine)."""
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(),
                                                   timeout=30).status


def _greedy(n: int):
    from loramux_engine import SamplingParams
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
