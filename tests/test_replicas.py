"""Two engine replicas behind one gateway and one control plane, as real processes on
loopback: adapters placed on both or on one, requests routed by where their adapter is,
per-replica residency in AdapterAdmin, a replica SIGKILLed under 50 live streams (every
stream whose adapter the other replica holds continues there, gRPC and OpenAI HTTP, greedy
and seeded, token for token as without the kill; one placed on the dead replica only ends
UNAVAILABLE with retry information within a bound), its rejoining after restart and
replay, and both replicas killed (every stream ends UNAVAILABLE with retry information
within a bound). Tests run in file order on one cluster; each runs alone too, but the
restart, which restarts the replica the kill before it killed, and the last, which kills
both."""
from __future__ import annotations

import asyncio
import json
import os
import time
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loramux import AdminClient, GenerateClient, LoramuxError
from loramux.aio import AsyncGenerateClient
from loramux.v1 import adapter_admin_pb2 as admin_pb2
from prometheus_client.parser import text_string_to_metric_families

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.support.streams import finish
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

# Services on CPU engines whatever LORAMUX_TEST_DEVICE says (two replicas need two devices;
# routing is the subject): the served engines and the in-process reference alike
# (tests/conftest.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.engine_device("cpu")]
ADAPTERS = {"both": 21, "solo1": 22, "solo0": 23}  # name -> seed
PROMPT = "the quick brown fox"
HEARTBEAT_TIMEOUT_S = 0.5
PEERS = ("--heartbeat-timeout", str(HEARTBEAT_TIMEOUT_S))
# a killed replica's streams end within the heartbeat timeout and this: room for a loaded
# machine's stalls (tests/test_liveness.py's margin)
KILL_MARGIN_S = 3.0
# how long the gateway waits for a replica to take a stream whose replica died
FAILOVER_WAIT_S = HEARTBEAT_TIMEOUT_S + 2.0
SEEDS = (11, 12, 13)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("replicas")
    model = make_model(root / "model", TinySpec())
    for name, seed in ADAPTERS.items():
        make_adapter(root / "adapters" / name, model, AdapterSpec(seed=seed))
    return {"root": root, "model": str(model), "adapters": str(root / "adapters")}


@pytest.fixture(scope="module")
def cluster(files):
    cfg = ClusterConfig(model=files["model"], adapter_roots=(files["adapters"],),
                        workdir=str(files["root"] / "run"), replicas=2, metrics_port=0,
                        # every step at least 20 ms: the kill test's 200-token streams run
                        # 4 s or more, so none ends between the inflight count and the kill
                        # however the test process is scheduled (1.5 s were left at full speed)
                        engine_args=("--device", "cpu", "--heartbeat-interval", "0.1",
                                     "--debug-step-sleep", "0.02"),
                        gateway_args=PEERS, control_args=PEERS, env={"OMP_NUM_THREADS": "1"},
                        http_port=0)
    c = Cluster(cfg)
    c.start()
    try:
        ready = c.wait_ready()
        wait_serving(c.gateway_address)
        c.metrics_url = f"http://127.0.0.1:{ready['gateway']['metrics_port']}/metrics"
        yield c
    finally:
        c.kill_all()


@pytest.fixture(scope="module")
def admin(cluster):
    with AdminClient(cluster.control_address) as a:
        a.load("both", "both")
        a.load("solo1", "solo1", replicas=[1])
        a.load("solo0", "solo0", replicas=[0])
        yield a


@pytest.fixture(scope="module")
def offline(files):
    eng = Engine(EngineConfig(model=files["model"]))
    for name in ADAPTERS:
        eng.add_adapter(name, os.path.join(files["adapters"], name))
    return eng


def expected(offline, adapter, max_tokens, **sampling):
    return expected_output(offline, adapter, max_tokens, **sampling).token_ids


def expected_output(offline, adapter, max_tokens, **sampling):
    params = SamplingParams(**{"temperature": 0.0, "max_tokens": max_tokens, **sampling})
    return offline.generate([PROMPT], params, adapters=[adapter])[0]


def failovers(cluster) -> dict[str, float]:
    """{reason: requests} the gateway sent again after their replica went down."""
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "loramux:requests_resumed_total"}


def openai_client(cluster) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{cluster.http_port}/v1",
                              api_key="unused", max_retries=0)


async def http_stream(client, max_tokens: int):
    """(text, usage, error or None) of one streamed OpenAI completion of `both`."""
    text, usage = [], None
    try:
        stream = await client.completions.create(
            model="both", prompt=PROMPT, max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += [c.text for c in chunk.choices]
            usage = chunk.usage or usage
    except openai.APIError as err:
        return "".join(text), usage, err
    return "".join(text), usage, None


def routed(cluster) -> dict[tuple[str, str], float]:
    """{(replica, decision): requests} from the gateway's metrics."""
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    return {(s.labels["replica"], s.labels["decision"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "loramux:routed_requests_total"}


def gauge(cluster, name: str) -> dict[str, float]:
    """{replica: value} of a gateway gauge with a replica label."""
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == name}


def adapters_on(cluster, replica: str) -> float:
    """Adapters the gateway's latest stats of `replica` list (any tier)."""
    text = urllib.request.urlopen(cluster.metrics_url, timeout=10).read().decode()
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "loramux:adapters" and s.labels["replica"] == replica)


def wait_gateway_sees(cluster, counts: dict[str, int], timeout_s: float = 60.0) -> None:
    """Until the gateway's latest stats of each replica list `counts[replica]` adapters:
    its routing decisions are then made on the residency the test set up."""
    deadline = time.monotonic() + timeout_s
    while any(adapters_on(cluster, r) < n for r, n in counts.items()):
        assert time.monotonic() < deadline, {r: adapters_on(cluster, r) for r in counts}
        time.sleep(0.1)


def health(address: str, service: str):
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=30).status


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def wait_resident(admin, names, timeout_s: float = 90.0) -> None:
    """Until every replica each adapter is placed on is up and reports holding it (the
    engines' stats follow a load within one stats interval)."""
    deadline = time.monotonic() + timeout_s
    while not all(r.up and r.residency != admin_pb2.RESIDENCY_UNSPECIFIED
                  for name in names for r in admin.get(name).replicas if r.placed):
        assert time.monotonic() < deadline, [admin.get(name) for name in names]
        time.sleep(0.1)


def placed_and_seen(cluster, admin) -> None:
    """Until each replica holds its adapters and the gateway routes on that residency
    (both + solo0; both + solo1): at once after the first test, which waits for it too."""
    wait_resident(admin, ADAPTERS)
    wait_gateway_sees(cluster, {"0": 2, "1": 2})


def test_adapters_are_placed_and_reported_per_replica(cluster, admin):
    placed_and_seen(cluster, admin)
    both, solo1 = admin.get("both"), admin.get("solo1")
    assert [(r.replica, r.up, r.placed) for r in both.replicas] == [(0, True, True), (1, True, True)]
    assert [(r.replica, r.placed) for r in solo1.replicas] == [(0, False), (1, True)]
    assert solo1.replicas[0].residency == admin_pb2.RESIDENCY_UNSPECIFIED
    assert solo1.replicas[1].residency in (admin_pb2.RESIDENCY_HOST, admin_pb2.RESIDENCY_DEVICE,
                                           admin_pb2.RESIDENCY_DISK)
    with pytest.raises(LoramuxError) as info:
        admin.load("both", replicas=[2])
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT and "2 engine replica" in info.value.details


def test_requests_go_to_the_replica_holding_their_adapter(cluster, admin, offline):
    """Deterministic: solo1 is on replica 1 only, solo0 on replica 0 only; every request
    for each lands there (a request on the other replica would fail: it lacks the
    adapter), and every one is an affinity hit (the adapter resident there)."""
    placed_and_seen(cluster, admin)  # also when it runs alone
    before = routed(cluster)
    with GenerateClient(cluster.gateway_address) as gen:
        for name in ("solo1", "solo0") * 4:
            got = gen.generate(PROMPT, name, temperature=0.0, max_tokens=4).token_ids
            assert got == expected(offline, name, 4), name
    moved = delta(routed(cluster), before)
    assert {r for r, _ in moved} == {"0", "1"}
    assert sum(v for (r, _), v in moved.items() if r == "1") == 4
    assert sum(v for (r, _), v in moved.items() if r == "0") == 4
    hits = sum(v for (_, d), v in moved.items() if d in ("slot", "host"))
    assert hits / sum(moved.values()) == 1.0, moved
    # each request's log line names the replica it ran on
    lines = [json.loads(line) for line in cluster.log_path("gateway").read_text().splitlines()
             if '"generate"' in line and '"solo' in line]
    assert {(d["adapter"], d["replica"], d["attempts"]) for d in lines[-8:]} == {
        ("solo1", 1, 1), ("solo0", 0, 1)}, lines[-8:]


def test_load_spreads_over_both_replicas(cluster, admin, offline):
    placed_and_seen(cluster, admin)  # also when it runs alone
    want = expected(offline, "both", 6)

    async def run():
        async with AsyncGenerateClient(cluster.gateway_address) as g:
            return await asyncio.gather(*[g.generate(PROMPT, "both", temperature=0.0, max_tokens=6)
                                          for _ in range(12)])
    before = routed(cluster)
    assert all(o.token_ids == want for o in asyncio.run(run()))
    per_replica = {}
    for (r, _), v in delta(routed(cluster), before).items():
        per_replica[r] = per_replica.get(r, 0) + v
    assert per_replica.get("0", 0) >= 3 and per_replica.get("1", 0) >= 3, per_replica


async def _open_streams(client, n: int, max_tokens: int):
    """n streams of `both`, each past its first response."""
    streams = [client.stream(PROMPT, "both", temperature=0.0, max_tokens=max_tokens,
                             ignore_eos=True) for _ in range(n)]
    firsts = await asyncio.gather(*[s.__anext__() for s in streams])
    return [(s, [f]) for s, f in zip(streams, firsts)]


def test_replica_killed_under_50_streams(cluster, admin, offline):
    """Streams past their first token, streams just sent, seeded sampled ones, OpenAI HTTP
    ones: none fails, each is what it is without the kill; a stream placed on the dead
    replica only ends UNAVAILABLE with a retry delay once the gateway's wait is over."""
    placed_and_seen(cluster, admin)  # also when it runs alone
    max_tokens = 200
    want = expected_output(offline, "both", max_tokens, ignore_eos=True)
    seeded = {seed: expected(offline, "both", 60, temperature=0.8, seed=seed, ignore_eos=True)
              for seed in SEEDS}
    before = failovers(cluster)

    async def scenario():
        async with AsyncGenerateClient(cluster.gateway_address) as client:
            # the router prefers the replica holding `both` in a better tier until it is
            # saturated by its latest stats, so a burst may lean on one replica: more streams
            # are opened (they run for seconds) until both are busy
            pairs = await _open_streams(client, 50, max_tokens)
            inflight = await asyncio.to_thread(gauge, cluster, "loramux:gateway_requests_inflight")
            for _ in range(10):
                if min(inflight.get("0", 0), inflight.get("1", 0)) >= 10:
                    break
                pairs += await _open_streams(client, 10, max_tokens)
                inflight = await asyncio.to_thread(gauge, cluster, "loramux:gateway_requests_inflight")
            late = [_stream(client, "both", max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
                    for _ in range(10)]
            sampled = [_stream(client, "both", max_tokens=60, temperature=0.8, seed=seed,
                               ignore_eos=True) for seed in SEEDS]
            solo0 = [_stream(client, "solo0", max_tokens=max_tokens, ignore_eos=True)
                     for _ in range(2)]
            async with openai_client(cluster) as http:
                web = [asyncio.ensure_future(http_stream(http, max_tokens)) for _ in range(4)]
                await asyncio.sleep(0.3)  # every call has reached the gateway
                t_kill = time.monotonic()
                await asyncio.to_thread(cluster.kill, "engine-0")
                results = await asyncio.gather(finish(pairs), *late, *sampled, *solo0, *web)
            return inflight, t_kill, results
    inflight, t_kill, (results, *rest) = asyncio.run(scenario())
    late, sampled, solo0, web = rest[:10], rest[10:13], rest[13:15], rest[15:]
    assert inflight["0"] >= 10 and inflight["1"] >= 10, inflight  # both replicas were busy
    assert [err for _, err, _ in results + late if err is not None] == []
    assert [_diverges(tokens, want.token_ids) for tokens, _, _ in results + late] == \
        [None] * len(results + late)
    assert [tokens for tokens, _, _ in sampled] == [seeded[seed] for seed in SEEDS]
    for text, usage, err in web:
        assert err is None and text == want.text
        assert usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == len(want.prompt_token_ids)
    moved = delta(failovers(cluster), before)
    assert moved.get("resumed", 0) >= inflight["0"], (moved, inflight)
    for _, err, t_end in solo0:  # nowhere to go: the dead replica alone holds it
        # (a call that had no response yet is retried by the client: the retry is refused)
        assert err.code == grpc.StatusCode.UNAVAILABLE and "replica" in err.details, err
        assert err.retry_delay and err.retry_delay > 0, err
        assert t_end - t_kill < FAILOVER_WAIT_S + KILL_MARGIN_S, t_end - t_kill
    with GenerateClient(cluster.gateway_address) as gen:  # the other replica serves on
        for name in ("both", "solo1", None):
            assert gen.generate(PROMPT, name, temperature=0.0, max_tokens=3).token_ids == \
                expected(offline, name, 3)
        with pytest.raises(LoramuxError) as info:  # placed on the dead replica only
            gen.generate(PROMPT, "solo0", max_tokens=3)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert "replica" in info.value.details
    assert [r.up for r in admin.get("both").replicas] == [False, True]
    # one replica up: the gateway stays ready; the liveness service is SERVING throughout
    assert health(cluster.gateway_address, "") == health(cluster.gateway_address, "liveness") == \
        health_pb2.HealthCheckResponse.SERVING


def _diverges(got: list[int], want: list[int]):
    """None when equal, else where they part and what is there (for the failure report)."""
    if got == want:
        return None
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return at, len(got), got[at:at + 3], want[at:at + 3]


async def _stream(client, adapter, **sampling):
    """(tokens, error or None, end time) of one Generate stream read to its end."""
    return (await finish([(client.stream(PROMPT, adapter, **sampling), [])]))[0]


def test_restarted_replica_rejoins_with_its_adapters(cluster, admin, offline):
    cluster.start("engine-0")
    cluster.wait_ready("engine-0")
    wait_resident(admin, ("both", "solo0"))  # the control plane replayed it
    wait_gateway_sees(cluster, {"0": 2})  # and the gateway has the replica's stats since
    before = routed(cluster)
    with GenerateClient(cluster.gateway_address) as gen:
        for name in ("solo0", "both"):
            assert gen.generate(PROMPT, name, temperature=0.0, max_tokens=4).token_ids == \
                expected(offline, name, 4)
    assert delta(routed(cluster), before).get(("0", "host"), 0) + \
        delta(routed(cluster), before).get(("0", "slot"), 0) >= 1
    assert gauge(cluster, "loramux:engine_up") == {"0": 1.0, "1": 1.0}


def test_both_replicas_killed(cluster, admin):
    """No replica left: every stream, started or not, ends UNAVAILABLE with retry
    information within the heartbeat timeout and the gateway's wait; OpenAI HTTP gets an
    error event in its stream, then a 503 with Retry-After."""
    wait_resident(admin, ("both",))  # also when it runs alone

    async def scenario():
        async with AsyncGenerateClient(cluster.gateway_address) as client:
            pairs = await _open_streams(client, 6, 400)
            async with openai_client(cluster) as http:
                web = asyncio.ensure_future(http_stream(http, 400))
                await asyncio.sleep(0.3)
                t_kill = time.monotonic()
                await asyncio.to_thread(cluster.kill, "engine-0")
                await asyncio.to_thread(cluster.kill, "engine-1")
                results = await finish(pairs)
                _, _, web_err = await web
                try:
                    await http.completions.create(model="both", prompt=PROMPT, max_tokens=3)
                    after = None
                except openai.APIStatusError as err:
                    after = err
            return t_kill, results, web_err, after
    t_kill, results, web_err, after = asyncio.run(scenario())
    for _, err, t_end in results:
        assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE, err
        assert err.retry_delay and err.retry_delay > 0, err
        assert t_end - t_kill < 2 * HEARTBEAT_TIMEOUT_S + FAILOVER_WAIT_S + KILL_MARGIN_S
    assert isinstance(web_err, openai.APIError) and "unavailable" in str(web_err), web_err
    assert after is not None and after.status_code == 503
    assert float(after.response.headers["retry-after"]) > 0
