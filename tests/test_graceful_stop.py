"""SIGTERM on a real `loramux serve` drains: the gateway refuses new calls (UNAVAILABLE) and
reports NOT_SERVING while the streams already running finish normally, then every process
exits."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from loramux import AdminClient, LoramuxError
from loramux.aio import AsyncGenerateClient
from loramux.v1 import generate_pb2

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_services.launcher import free_port, wait_serving
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

ROOT = Path(__file__).resolve().parents[1]
STREAMS, MAX_TOKENS = 20, 400  # long enough to be streaming through a loaded machine's drain
PROMPTS = ["the quick brown fox", "once upon a time", "def main():", "héllo wörld"]
# Services on CPU engines whatever LORAMUX_TEST_DEVICE says (draining is the subject, not
# the device): the served engines and the in-process reference alike (tests/conftest.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.engine_device("cpu")]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("drain")
    model = make_model(root / "model", TinySpec())
    make_adapter(root / "adapters" / "a1", model, AdapterSpec(seed=5))
    return root


def _serve(files: Path, ports: list[int]) -> subprocess.Popen:
    args = ["serve", "--model", str(files / "model"), "--adapter-root", str(files / "adapters"),
            "--device", "cpu", "--gateway-port", str(ports[0]), "--control-port", str(ports[1]),
            "--metrics-port", "-1", "--http-port", "0", "--workdir", str(files / "run"),
            "--shutdown-grace", "60"]
    code = f"import sys; from loramux.cli import main; sys.exit(main({args!r}))"
    path = os.pathsep.join(p for p in (str(ROOT), str(ROOT / "clients" / "python"),
                                       os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=30).status


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def _stream(client, prompt, adapter, started: asyncio.Event, counter: list):
    """(tokens, finish reason, end time) of one stream; `started` is set once STREAMS
    streams have their first token."""
    tokens, last = [], None
    async for resp in client.stream(prompt, adapter, temperature=0.0, max_tokens=MAX_TOKENS,
                                    ignore_eos=True):
        if not tokens:
            counter.append(1)
            if len(counter) == STREAMS:
                started.set()
        tokens.extend(resp.token_ids)
        last = resp
    return tokens, last.finish_reason, time.monotonic()


def test_sigterm_drains_in_flight_streams(files):
    ports = [free_port(), free_port()]
    gateway = f"127.0.0.1:{ports[0]}"
    proc = _serve(files, ports)
    pids: list[int] = []
    try:
        wait_serving(gateway, timeout_s=120)
        with AdminClient(f"127.0.0.1:{ports[1]}") as admin:
            admin.load("a1", "a1")
        pids = [json.loads((files / "run" / f"{n}.ready.json").read_text())["pid"]
                for n in ("engine", "control", "gateway")]
        prompts = [PROMPTS[i % 4] for i in range(STREAMS)]
        adapters = ["a1" if i % 2 else None for i in range(STREAMS)]

        async def scenario():
            async with AsyncGenerateClient(gateway, retry=False) as client:
                started, counter = asyncio.Event(), []
                tasks = [asyncio.create_task(_stream(client, p, a, started, counter))
                         for p, a in zip(prompts, adapters)]
                await asyncio.wait_for(started.wait(), 60)
                proc.send_signal(signal.SIGTERM)
                while await asyncio.to_thread(_health, gateway) != \
                        health_pb2.HealthCheckResponse.NOT_SERVING:
                    await asyncio.sleep(0.02)
                t_draining = time.monotonic()
                with pytest.raises(LoramuxError) as refused:
                    await client.generate("hi", None, max_tokens=2)
                return t_draining, refused.value, await asyncio.gather(*tasks)
        t_draining, refused, results = asyncio.run(scenario())
        assert refused.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in str(refused)
        with Engine(EngineConfig(model=str(files / "model"))) as offline:
            offline.add_adapter("a1", str(files / "adapters" / "a1"))
            want = offline.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                            ignore_eos=True), adapters=adapters)
        for (tokens, reason, t_end), w in zip(results, want):
            assert reason == generate_pb2.FINISH_REASON_LENGTH
            assert tokens == w.token_ids
        # all 20 were still streaming when the gateway was already draining
        assert min(t_end for _, _, t_end in results) > t_draining
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out[-3000:]
        assert "draining" in out
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids):
            assert time.monotonic() < deadline, [p for p in pids if _alive(p)]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        for pid in pids:  # the services run in their own sessions: never leave one behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_sigterm_on_the_engine_alone_drains(files, tmp_path):
    """As compose stops one container: the engine refuses new requests and finishes the
    running ones before it exits."""
    from loramux_services.launcher import Cluster, ClusterConfig

    # every step at least 30 ms: the streams run for 4.8 s or more however fast the machine,
    # so the refusal of a call made after the signal still comes while they run (160 steps
    # at full speed left 0.3 s between the two on a loaded machine)
    cfg = ClusterConfig(model=str(files / "model"), adapter_roots=(str(files / "adapters"),),
                        workdir=str(tmp_path / "run"), env={"OMP_NUM_THREADS": "1"},
                        engine_args=("--device", "cpu", "--debug-step-sleep", "0.03"))
    with Cluster(cfg) as c:
        c.start()
        c.wait_ready()
        wait_serving(c.gateway_address)
        n = 6

        async def scenario():
            async with AsyncGenerateClient(c.gateway_address, retry=False) as client:
                started, counter = asyncio.Event(), []
                tasks = [asyncio.create_task(_stream(client, PROMPTS[i % 4], None, started, counter))
                         for i in range(n)]
                while len(counter) < n:
                    await asyncio.sleep(0.01)
                stopping = asyncio.create_task(asyncio.to_thread(c.stop, "engine", signal.SIGTERM))
                # until the engine has the signal: a call may still be served before that
                deadline = time.monotonic() + 60
                while True:
                    assert time.monotonic() < deadline, "no call was refused"
                    try:
                        await client.generate("hi", None, max_tokens=2)
                    except LoramuxError as err:
                        refused = err
                        break
                    await asyncio.sleep(0.05)
                t_refused = time.monotonic()
                return refused, t_refused, await asyncio.gather(*tasks), await stopping
        refused, t_refused, results, code = asyncio.run(scenario())
    assert refused.code == grpc.StatusCode.UNAVAILABLE and "shutting down" in str(refused)
    assert code == 0
    for tokens, reason, t_end in results:
        assert reason == generate_pb2.FINISH_REASON_LENGTH and len(tokens) == MAX_TOKENS
        assert t_end > t_refused  # still streaming while new requests were refused
