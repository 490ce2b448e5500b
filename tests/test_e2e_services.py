"""End-to-end: engine, control plane and gateway as real processes on loopback, driven
through the client SDK. Tests run in file order on one cluster; the ones that kill a
process come last and leave the cluster serving again."""
from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time

import grpc
import pytest
from loramux import AdminClient, GenerateClient, LoramuxError
from loramux.aio import AsyncGenerateClient
from loramux.v1 import adapter_admin_pb2 as admin_pb2

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.conftest import served_engine_args
from tests.support.streams import finish
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

TOKEN = "s3cret-token"
PROMPTS = ["the quick brown fox", "héllo wörld, ça va?", "once upon a time", "def main():"]
LONG = 120  # max_tokens of streams that must still be running while something happens
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("e2e")
    model = make_model(root / "model", TinySpec())
    adapters = root / "adapters"
    for i, name in enumerate(("a1", "a2", "a3"), start=1):
        make_adapter(adapters / name, model, AdapterSpec(seed=10 + i))
    make_adapter(root / "outside" / "x", model, AdapterSpec(seed=99))
    return {"root": root, "model": str(model), "adapters": str(adapters)}


@pytest.fixture(scope="module")
def cluster(files):
    cfg = ClusterConfig(model=files["model"], adapter_roots=(files["adapters"],),
                        workdir=str(files["root"] / "run"), auth_token=TOKEN, metrics_port=0,
                        gateway_args=("--max-inflight", "250", "--max-message-bytes", str(1 << 20)),
                        # the engine as it runs on one GPU by default: step N+1 launched
                        # before step N's tokens are read (sync is covered by the engine
                        # tests and by tests/test_compose.py)
                        # where and in the dtype the offline engine runs (tests/conftest.py)
                        engine_args=("--async-scheduling", "on", *served_engine_args()),
                        env={"OMP_NUM_THREADS": "1"})
    c = Cluster(cfg)
    c.start()
    try:
        c.wait_ready()
        wait_serving(c.gateway_address)
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def admin(cluster):
    with AdminClient(cluster.control_address, token=TOKEN) as a:
        a.load("a1", "a1")
        a.load("a2", "a2", pinned=True)
        a.load("a3", "a3")
        yield a


@pytest.fixture(scope="module")
def gen(cluster, admin):
    with GenerateClient(cluster.gateway_address) as g:
        yield g


@pytest.fixture(scope="module")
def offline(files):
    """The in-process engine with the same adapters: the expected tokens."""
    eng = Engine(EngineConfig(model=files["model"]))
    for name in ("a1", "a2", "a3"):
        eng.add_adapter(name, os.path.join(files["adapters"], name))
    return eng


def expected(offline, prompts, adapters, max_tokens, **kw):
    outs = offline.generate(list(prompts), SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw),
                            adapters=list(adapters))
    return [o.token_ids for o in outs]


def code_of(fn) -> grpc.StatusCode:
    with pytest.raises(LoramuxError) as info:
        fn()
    return info.value.code


def is_idle(msg) -> bool:
    """No request, no referenced KV block, no adapter reference left in the engine."""
    if msg.WhichOneof("kind") != "event":
        return False
    ev = msg.event
    return (ev.running_requests == 0 and ev.waiting_requests == 0
            and ev.counters.kv_blocks_free == ev.counters.kv_blocks_total
            and all(a.in_flight_requests == 0 for a in ev.adapters))


def assert_idle(cluster, timeout_s: float = 60.0):
    seen: list = []
    got = cluster.wait_output(is_idle, timeout_s, last=seen)
    events = [m.event for m in seen if m.WhichOneof("kind") == "event"]
    assert got is not None, f"engine not idle after {timeout_s} s: {events[-1:]}"


# ---- serving -----------------------------------------------------------------------

def test_concurrent_streams_match_offline_engine(cluster, admin, offline):
    names = ["a1", "a2", "a3", None] * 2
    prompts = [PROMPTS[(i + i // 4) % 4] for i in range(len(names))]  # 8 distinct pairs
    want = expected(offline, prompts, names, 24)

    async def run():
        async with AsyncGenerateClient(cluster.gateway_address) as g:
            return await asyncio.gather(*[
                g.generate(p, n, temperature=0.0, max_tokens=24) for p, n in zip(prompts, names)])
    got = asyncio.run(run())
    assert [c.token_ids for c in got] == want
    assert all(c.finish_reason in ("length", "eos") for c in got)
    assert len({tuple(w) for w in want}) == 8  # adapters really change the outputs
    done = got[0]
    assert done.usage.completion_tokens == len(done.token_ids)
    assert done.usage.prompt_tokens > 0 and done.timings.total_s > 0


def test_streamed_text_is_offline_text(gen, offline):
    resp = list(gen.stream(PROMPTS[1], "a1", temperature=0.0, max_tokens=40, ignore_eos=True))
    out = offline.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
                           adapters=["a1"])[0]
    assert "".join(r.text for r in resp) == out.text
    assert [t for r in resp for t in r.token_ids] == out.token_ids
    assert sum(1 for r in resp if r.finish_reason) == 1 and resp[-1].finish_reason


def test_stop_strings_and_logprobs(gen, offline):
    base = offline.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))[0]
    stop = base.text[5:8]
    assert stop.strip(), f"need a visible stop string in {base.text!r}"
    got = gen.generate(PROMPTS[0], None, temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop])
    want = offline.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                         stop=[stop]))[0]
    assert got.finish_reason == "stop" and got.text == want.text and stop not in got.text
    resp = list(gen.stream(PROMPTS[0], None, temperature=0.0, max_tokens=4, logprobs=True, top_logprobs=2))
    lps = [lp for r in resp for lp in r.logprobs]
    assert len(lps) == 4 and all(len(lp.top) == 2 and lp.logprob <= 0 for lp in lps)


def test_admin_get_list_and_pagination(admin):
    a2 = admin.get("a2")
    assert a2.state == admin_pb2.ADAPTER_STATE_LOADED and a2.pinned and a2.rank == 8
    assert a2.id > 0 and "q_proj" in a2.target_modules
    assert a2.residency in (admin_pb2.RESIDENCY_DEVICE, admin_pb2.RESIDENCY_HOST)
    assert [a.name for a in admin.list(page_size=1)] == ["a1", "a2", "a3"]


def test_pin_and_unpin_reach_the_engine(cluster, admin):
    def engine_pins():
        ev = cluster.wait_output(lambda m: m.WhichOneof("kind") == "event", 30)
        return {a.name: a.pinned for a in ev.event.adapters}
    assert admin.pin("a1").pinned and engine_pins()["a1"] is True
    assert not admin.unpin("a1").pinned and engine_pins()["a1"] is False
    assert admin.get("a2").pinned and engine_pins()["a2"] is True


def test_health_reflection_and_metrics(cluster, gen):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    import urllib.request

    for name in ("a1", "a2"):  # its own requests: the counters below do not rely on other tests
        gen.generate(PROMPTS[0], name, temperature=0.0, max_tokens=3, ignore_eos=True)
    with grpc.insecure_channel(cluster.gateway_address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        names = {s.name for s in resp.list_services_response.service}
    assert "loramux.v1.GenerateService" in names and "grpc.health.v1.Health" in names
    ready = cluster.wait_ready("gateway")["gateway"]
    text = urllib.request.urlopen(f"http://127.0.0.1:{ready['metrics_port']}/metrics").read().decode()
    assert 'loramux_requests_total{adapter="a1",status="OK"}' in text
    assert "loramux_time_to_first_token_seconds_bucket" in text
    assert "loramux_inter_token_latency_seconds_count" in text
    assert 'loramux_generated_tokens_total{adapter="a2"}' in text


def test_cli_generate_and_adapters(cluster, admin, offline):
    env = {**os.environ, "LORAMUX_ADMIN_TOKEN": TOKEN}
    out = subprocess.run([sys.executable, "-m", "loramux.cli", "adapters", "--control",
                          cluster.control_address, "list"], capture_output=True, text=True, env=env,
                         timeout=60, check=True)
    assert [a["name"] for a in json.loads(out.stdout)] == ["a1", "a2", "a3"]
    out = subprocess.run([sys.executable, "-m", "loramux.cli", "generate", "--gateway",
                          cluster.gateway_address, "--adapter", "a1", "--max-tokens", "12",
                          PROMPTS[2]], capture_output=True, text=True, timeout=60, check=True)
    want = offline.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=12),
                            adapters=["a1"])[0].text
    assert out.stdout == want + "\n"
    bad = subprocess.run([sys.executable, "-m", "loramux.cli", "adapters", "--control",
                          cluster.control_address, "get", "nope"], capture_output=True, text=True,
                         env=env, timeout=60)
    assert bad.returncode == 1 and "NOT_FOUND" in bad.stderr


# ---- bad input: each with its exact status -------------------------------------------

def test_bad_generate_requests(gen, admin):
    assert code_of(lambda: gen.generate("hi", "nope", max_tokens=2)) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: gen.generate([5] * 1024, None, max_tokens=2)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: gen.generate([5] * 1000, None, max_tokens=100)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: gen.generate([100000], None, max_tokens=2)) == grpc.StatusCode.INVALID_ARGUMENT
    for bad in (dict(temperature=-1.0), dict(top_p=0.0), dict(top_k=-2), dict(min_p=2.0),
                dict(repetition_penalty=0.0), dict(max_tokens=0), dict(top_logprobs=50),
                dict(stop=[""]), dict(stop_token_ids=[10**6])):
        with pytest.raises(LoramuxError) as info:
            gen.generate("hi", None, **{"max_tokens": 2, **bad})
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, bad
        assert next(iter(bad)) in info.value.details
    assert code_of(lambda: gen.generate("", None)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: gen.generate("x" * (2 << 20), None)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    # nothing else disturbed
    assert gen.generate("hi", "a1", temperature=0.0, max_tokens=3).finish_reason in ("length", "eos")


def test_bad_admin_requests(cluster, admin, files):
    root = files["root"]
    bad_dir = os.path.join(files["adapters"], "broken")
    os.makedirs(bad_dir, exist_ok=True)
    with open(os.path.join(bad_dir, "adapter_config.json"), "w") as f:
        f.write("{not json")
    biased = os.path.join(files["adapters"], "lora_bias")
    make_adapter(biased, files["model"], AdapterSpec(), lora_bias=True)
    os.symlink(str(root / "outside" / "x"), os.path.join(files["adapters"], "escape"))
    cases = [
        (lambda: admin.register("broken", "broken"), grpc.StatusCode.INVALID_ARGUMENT, "adapter_config.json"),
        (lambda: admin.register("biased", "lora_bias"), grpc.StatusCode.INVALID_ARGUMENT, "lora_bias"),
        (lambda: admin.register("x", str(root / "outside" / "x")), grpc.StatusCode.PERMISSION_DENIED, "outside"),
        (lambda: admin.register("x", "../outside/x"), grpc.StatusCode.PERMISSION_DENIED, ".."),
        (lambda: admin.register("x", "escape"), grpc.StatusCode.PERMISSION_DENIED, "symbolic link"),
        (lambda: admin.register("bad name!", "a1"), grpc.StatusCode.INVALID_ARGUMENT, "invalid"),
        (lambda: admin.load("nope"), grpc.StatusCode.NOT_FOUND, "nope"),
        (lambda: admin.register("a1", "a2"), grpc.StatusCode.ALREADY_EXISTS, "a1"),
        (lambda: admin.unregister("a1"), grpc.StatusCode.FAILED_PRECONDITION, "unload"),
    ]
    for fn, code, words in cases:
        with pytest.raises(LoramuxError) as info:
            fn()
        assert info.value.code == code, (info.value, code)
        assert words in info.value.details, info.value.details
    for token in (None, "wrong"):
        with AdminClient(cluster.control_address, token=token) as anon:
            assert code_of(anon.list) == grpc.StatusCode.UNAUTHENTICATED
            assert code_of(lambda: anon.load("a1")) == grpc.StatusCode.UNAUTHENTICATED
    assert [a.name for a in admin.list()] == ["a1", "a2", "a3"]


def test_registered_not_loaded_is_failed_precondition(admin, gen):
    admin.register("a1-copy", "a1")
    try:
        with pytest.raises(LoramuxError) as info:
            gen.generate("hi", "a1-copy", max_tokens=2)
        assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "not loaded" in info.value.details
    finally:
        admin.unregister("a1-copy")


def test_admission_limit(cluster, files):
    cmd = cluster.command("gateway")
    listen = f"127.0.0.1:{__import__('loramux_services.launcher', fromlist=['free_port']).free_port()}"
    cmd[cmd.index("--listen") + 1] = listen
    cmd[cmd.index("--ready-file") + 1] = str(files["root"] / "gw2.ready")
    proc = subprocess.Popen(cmd + ["--max-inflight", "2"], stderr=subprocess.DEVNULL)
    try:
        wait_serving(listen)

        async def run():
            async with AsyncGenerateClient(listen, retry=False) as g:  # the refusal itself
                # 900 tokens: still running when the third call arrives, however slow the
                # machine (they are cancelled below, never read to their end)
                streams = [g.stream("hi", None, temperature=0.0, max_tokens=900, ignore_eos=True)
                           for _ in range(2)]
                for s in streams:
                    await s.__anext__()
                with pytest.raises(LoramuxError) as info:
                    await g.generate("hi", None, max_tokens=2)
                for s in streams:
                    await s.aclose()
                return info.value.code
        assert asyncio.run(run()) == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert_idle(cluster)


# ---- cancellation and load ---------------------------------------------------------

def test_deadline_aborts_in_engine(cluster, gen):
    with pytest.raises(LoramuxError) as info:
        for _ in gen.stream("hi", "a3", timeout=0.3, temperature=0.0, max_tokens=900, ignore_eos=True):
            pass
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(cluster)


def test_200_streams_with_random_cancels(cluster, admin, offline):
    rng = random.Random(0)
    names = ["a1", "a2", "a3", None]
    jobs = [(PROMPTS[i % 4], names[(i // 4) % 4]) for i in range(200)]
    cancel = set(rng.sample(range(200), 40))
    want = {}
    for p, n in set(jobs):
        want[(p, n)] = expected(offline, [p], [n], 8)[0]

    async def one(g, i, p, n):
        if i in cancel:
            stream = g.stream(p, n, temperature=0.0, max_tokens=8)
            async for _ in stream:
                break  # leave after the first tokens: the gateway aborts it
            await stream.aclose()
            return None
        return await g.generate(p, n, temperature=0.0, max_tokens=8)

    async def run():
        async with AsyncGenerateClient(cluster.gateway_address) as g:
            return await asyncio.gather(*[one(g, i, p, n) for i, (p, n) in enumerate(jobs)])
    t0 = time.monotonic()
    results = asyncio.run(run())
    for i, ((p, n), got) in enumerate(zip(jobs, results)):
        if i not in cancel:
            assert got.token_ids == want[(p, n)], (i, p, n)
    assert time.monotonic() - t0 < 120
    assert_idle(cluster)


# ---- lifecycle under traffic --------------------------------------------------------

async def _open(client, adapter, prompts, max_tokens=LONG):
    """Open streams and wait for each one's first response."""
    pairs = []
    for p in prompts:
        stream = client.stream(p, adapter, temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        pairs.append((stream, [await stream.__anext__()]))
    return pairs


def test_unload_during_streaming(cluster, admin, gen, offline):
    prompts = PROMPTS[:3]
    want = expected(offline, prompts, ["a3"] * 3, LONG, ignore_eos=True)

    async def scenario():
        async with AsyncGenerateClient(cluster.gateway_address) as client:
            pairs = await _open(client, "a3", prompts)
            await asyncio.to_thread(admin.unload, "a3")
            # refused whichever sees the unload first: the gateway (its adapter table) or
            # the engine (a retiring adapter takes no new request); how long a refusal
            # waits for tables is tests/test_gateway_table.py's
            with pytest.raises(LoramuxError) as info:
                await client.generate("hi", "a3", max_tokens=2)
            return info.value.code, await finish(pairs)
    code, results = asyncio.run(scenario())
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert [r[0] for r in results] == want and all(r[1] is None for r in results)
    deadline = time.monotonic() + 30
    while admin.get("a3").state != admin_pb2.ADAPTER_STATE_REGISTERED:
        assert time.monotonic() < deadline, admin.get("a3")
        time.sleep(0.1)
    admin.load("a3")
    assert gen.generate("hi", "a3", temperature=0.0, max_tokens=3).token_ids == \
        expected(offline, ["hi"], ["a3"], 3)[0]


def test_control_plane_restart(cluster, admin, gen, offline):
    before = {a.name: (a.state, a.pinned, a.id, a.path) for a in admin.list()}
    want = expected(offline, PROMPTS[:2], ["a1", "a2"], LONG, ignore_eos=True)

    async def scenario():
        async with AsyncGenerateClient(cluster.gateway_address) as client:
            pairs = await _open(client, "a1", PROMPTS[:1]) + await _open(client, "a2", PROMPTS[1:2])
            await asyncio.to_thread(cluster.kill, "control")
            return await finish(pairs)
    results = asyncio.run(scenario())
    assert [r[0] for r in results] == want and all(r[1] is None for r in results)
    # with the control plane down, the gateway keeps serving from its last table
    assert gen.generate("hi", "a1", temperature=0.0, max_tokens=3).finish_reason
    cluster.start("control")
    cluster.wait_ready("control")
    wait_serving(cluster.control_address)
    after = {a.name: (a.state, a.pinned, a.id, a.path) for a in admin.list()}
    assert after == before
    assert gen.generate("hi", "a2", temperature=0.0, max_tokens=3).token_ids == \
        expected(offline, ["hi"], ["a2"], 3)[0]


def test_engine_killed_mid_stream_then_replayed(cluster, admin, gen, offline):
    old_instance = cluster.wait_output(lambda m: True, 30).instance_id

    async def scenario():
        async with AsyncGenerateClient(cluster.gateway_address) as client:
            pairs = await _open(client, "a1", PROMPTS[:2], max_tokens=900)
            t_kill = time.monotonic()
            await asyncio.to_thread(cluster.kill, "engine")
            return t_kill, await finish(pairs)
    t_kill, results = asyncio.run(scenario())
    for tokens, err, t_end in results:
        assert err is not None and err.code == grpc.StatusCode.UNAVAILABLE, err
        # the gateway's heartbeat timeout (1.5 s by default), its wait for another replica
        # to take the streams (2 s; there is none) and room for a loaded machine's stalls;
        # a stream nothing ends would hang
        assert t_end - t_kill < 7.0, t_end - t_kill
    assert code_of(lambda: gen.generate("hi", None, max_tokens=2)) == grpc.StatusCode.UNAVAILABLE
    cluster.start("engine")
    cluster.wait_ready("engine")
    wait_serving(cluster.gateway_address)
    # the control plane replays (loads with their pins) after the new engine's first heartbeat
    ev = cluster.wait_output(lambda m: m.WhichOneof("kind") == "event"
                             and len(m.event.adapters) == 3, 30)
    assert ev is not None, "no replay"
    assert {a.name: a.pinned for a in ev.event.adapters} == {"a1": False, "a2": True, "a3": False}
    assert ev.instance_id != old_instance
    deadline = time.monotonic() + 30
    while {a.name: a.id for a in admin.list()} != {a.name: a.id for a in ev.event.adapters}:
        assert time.monotonic() < deadline, (admin.list(), ev.event.adapters)
        time.sleep(0.1)
    assert all(a.state == admin_pb2.ADAPTER_STATE_LOADED for a in admin.list())
    for name in ("a1", "a2", "a3", None):
        assert gen.generate(PROMPTS[0], name, temperature=0.0, max_tokens=6).token_ids == \
            expected(offline, [PROMPTS[0]], [name], 6)[0]


def test_gateway_graceful_shutdown(cluster, offline):
    want = expected(offline, PROMPTS[:1], [None], LONG, ignore_eos=True)

    async def scenario():
        async with AsyncGenerateClient(cluster.gateway_address) as client:
            pairs = await _open(client, None, PROMPTS[:1])
            stop = asyncio.create_task(asyncio.to_thread(cluster.stop, "gateway", signal.SIGTERM))
            results = await finish(pairs)
            return results, await stop
    results, code = asyncio.run(scenario())
    assert results[0][1] is None and results[0][0] == want[0]
    assert code == 0
    cluster.start("gateway")
    cluster.wait_ready("gateway")
    wait_serving(cluster.gateway_address)
