"""`loramux serve` keeps its processes alive: the real entry point with two CPU engine
replicas, the tiny model and PEFT adapters, streams in flight, then an engine replica, the
gateway and the control plane SIGKILLed one after the other. Each starts again on its
addresses; the service keeps serving meanwhile; the restarted replica is replayed its
adapters and takes requests again; `loramux status` shows its states. A process that keeps
dying (its model directory gone) stops the service with one line naming it and its log.
Tests run in file order on one service (each kill test restores what it killed)."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import grpc
import pytest
from loramux import AdminClient, GenerateClient, LoramuxError
from loramux.aio import AsyncGenerateClient

from loramux_services.launcher import wait_serving
from tests.support.serve_process import ServeProcess
from tests.support.streams import finish
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

pytestmark = [pytest.mark.timeout(400), pytest.mark.engine_device("cpu")]
HEARTBEAT = ("--heartbeat-timeout", "2")  # a loaded CPU stalls processes for a second
PROMPTS = ([5, 6, 7, 8], [40, 41, 42])
ADAPTERS = ("a", "")        # streams use the shared adapter and the base model
STREAMS = 24
LONG = 1500                  # tokens per stream: in flight for seconds on this CPU
SHORT = 12


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("supervision")
    model = make_model(root / "model", TinySpec(max_position_embeddings=4096))
    make_adapter(root / "adapters" / "a", model, AdapterSpec(seed=31))
    make_adapter(root / "adapters" / "solo1", model, AdapterSpec(seed=32))
    return root


def _serve(files, workdir, *extra) -> ServeProcess:
    return ServeProcess(workdir, "--model", str(files / "model"), "--adapter-root",
                        str(files / "adapters"), "--device", "cpu", "--gateway-port", "0",
                        "--control-port", "0", "--http-port", "0", "--metrics-port", "-1",
                        "--shutdown-grace", "2", "--restart-backoff", "0.2", *HEARTBEAT, *extra)


@pytest.fixture(scope="module")
def served(files):
    s = _serve(files, files / "run", "--replicas", "2")
    try:
        s.wait_serving()
        with AdminClient(s.control) as admin:
            admin.load("a", "a")
            admin.load("solo1", "solo1", replicas=[1])  # only the replica the test kills
        yield s
    finally:
        s.stop()


def _generate(gateway: str, prompt, adapter: str, n: int = SHORT) -> list[int]:
    with GenerateClient(gateway) as gen:
        return list(gen.generate(prompt, adapter or None, temperature=0.0, max_tokens=n,
                                 ignore_eos=True).token_ids)


async def _run_all(gateway: str, jobs, n: int) -> list:
    """(tokens, error) of each (prompt, adapter) job, all at once."""
    async with AsyncGenerateClient(gateway) as gen:
        pairs = []
        for prompt, adapter in jobs:
            pairs.append((gen.stream(prompt, adapter or None, temperature=0.0, max_tokens=n,
                                     ignore_eos=True), []))
        return [(toks, err) for toks, err, _ in await finish(pairs)]


def _jobs(count: int):
    return [(PROMPTS[i % len(PROMPTS)], ADAPTERS[(i // len(PROMPTS)) % len(ADAPTERS)])
            for i in range(count)]


def _transitions(log: str, replica: int) -> list[tuple[str, str]]:
    """(old, new) of each state change the control plane logged for `replica`."""
    out = []
    for line in log.splitlines():
        if '"replica_state"' not in line:
            continue
        try:
            rec = json.loads(line[line.index("{"):])
        except ValueError:
            continue
        if rec.get("event") == "replica_state" and rec.get("replica") == replica:
            out.append((rec["old"], rec["new"]))
    return out


def _wait_states(served: ServeProcess, want, timeout_s: float = 180.0) -> list[list[str]]:
    """Poll `loramux status` until want(states); every distinct reading seen."""
    seen, deadline = [], time.monotonic() + timeout_s
    while True:
        states = served.states()
        if not seen or seen[-1] != states:
            seen.append(states)
        if want(states):
            return seen
        assert served.proc.poll() is None, served.stderr
        assert time.monotonic() < deadline, (seen, served.stderr)
        time.sleep(0.3)


async def _kill_under_streams(served: ServeProcess) -> dict:
    """24 long streams, engine-1 SIGKILLed once each has its first tokens; what followed."""
    jobs = _jobs(STREAMS)
    async with AsyncGenerateClient(served.gateway) as gen:
        streams = [gen.stream(prompt, adapter or None, temperature=0.0, max_tokens=LONG,
                              ignore_eos=True) for prompt, adapter in jobs]
        firsts = await asyncio.gather(*[s.__anext__() for s in streams])
        pairs = [(s, [first]) for s, first in zip(streams, firsts)]
        old_pid = served.kill("engine-1")
        rest = asyncio.ensure_future(finish(pairs))
        # once the service knows replica 1 is gone, new requests go to replica 0 alone
        seen = await asyncio.to_thread(_wait_states, served, lambda s: s[1] != "serving")
        back = asyncio.Event()
        solo = asyncio.ensure_future(_ask_until(served.gateway, "solo1", back))
        fresh = await _run_all(served.gateway, _jobs(STREAMS), SHORT)
        seen += await asyncio.to_thread(_wait_states, served, lambda s: s == ["serving"] * 2)
        back.set()
        streams = [(toks, err) for toks, err, _ in await rest]
    return {"jobs": jobs, "streams": streams, "fresh": fresh, "seen": seen, "old_pid": old_pid,
            "solo": await solo}


async def _ask_until(gateway: str, adapter: str, stop: asyncio.Event) -> list:
    """(tokens, error) of requests for `adapter`, one after the other until `stop`."""
    out = []
    async with AsyncGenerateClient(gateway) as gen:
        while not stop.is_set():
            try:
                toks = [t async for r in gen.stream(PROMPTS[0], adapter, temperature=0.0,
                                                    max_tokens=SHORT, ignore_eos=True)
                        for t in r.token_ids]
                out.append((toks, None))
            except LoramuxError as err:
                out.append((None, err))
            await asyncio.sleep(0.1)
    return out


@pytest.fixture(scope="module")
def references(served):
    """Each job's tokens from the service before any fault."""
    jobs = sorted(set((tuple(p), a) for p, a in _jobs(len(PROMPTS) * len(ADAPTERS))))
    long = asyncio.run(_run_all(served.gateway, jobs, LONG))
    assert all(err is None for _, err in long), long
    return {"long": dict(zip(jobs, (t for t, _ in long))),
            "short": {job: toks[:SHORT] for job, (toks, _) in zip(jobs, long)},
            "solo1": _generate(served.gateway, PROMPTS[0], "solo1")}


@pytest.fixture(scope="module")
def engine_kill(served, references):
    assert served.states() == ["serving", "serving"]
    return asyncio.run(_kill_under_streams(served))


def test_a_killed_replica_restarts_and_serves_its_adapters_again(served, references, engine_kill):
    assert served.proc.poll() is None, served.stderr  # serve kept running
    assert "engine-1 was killed by SIGKILL; restarting it in 0.2 s (attempt 1" in served.stderr
    assert served.pid("engine-1") != engine_kill["old_pid"]
    # the states the control plane showed: both serving, replica 1 down, then back
    seen = engine_kill["seen"]
    assert seen[0] == ["serving", "serving"] or seen[0][1] in ("restarting", "starting"), seen
    assert seen[-1] == ["serving", "serving"], seen
    # "restarting" lasts from the lost heartbeat to the new engine's first serving one; a
    # poll of `loramux status` can miss it on a slow machine, the control plane's own log of
    # transitions (checked every 0.5 s) does not
    logged = _transitions((served.workdir / "control.log").read_text(), replica=1)
    assert ("serving", "restarting") in logged and logged[-1][1] == "serving", logged
    assert all(s[0] == "serving" for s in seen), seen
    assert [r["restarts"] for r in served.status()] == [0, 1]
    # requests made while it was down all succeeded, with the no-fault tokens
    for (prompt, adapter), (toks, err) in zip(_jobs(STREAMS), engine_kill["fresh"]):
        assert err is None and toks == references["short"][(tuple(prompt), adapter)], err
    # streams on the live replica finished with the no-fault tokens; the others died with
    # their replica
    for (prompt, adapter), (toks, err) in zip(engine_kill["jobs"], engine_kill["streams"]):
        if err is None:
            assert toks == references["long"][(tuple(prompt), adapter)]
        else:
            assert "replica 1" in str(err), err
    # the adapter placed only on replica 1 was replayed to it and it takes requests again
    assert _generate(served.gateway, PROMPTS[0], "solo1") == references["solo1"]


def test_a_restarted_replica_takes_adapter_requests_only_once_replayed(references, engine_kill):
    """Requests for the adapter placed only on the restarted replica, made while it was
    down and while it came back: UNAVAILABLE (retry) until its adapters were replayed, then
    served; never sent to it before (the engine would refuse them as not loaded)."""
    asked = engine_kill["solo"]
    assert asked and asked[-1] == (references["solo1"], None), asked[-3:]
    for toks, err in asked:
        assert (err is None and toks == references["solo1"]) or (
            err.code == grpc.StatusCode.UNAVAILABLE), err


def test_no_stream_is_lost_when_a_replica_dies(references, engine_kill):
    for (prompt, adapter), (toks, err) in zip(engine_kill["jobs"], engine_kill["streams"]):
        assert err is None, err
        assert toks == references["long"][(tuple(prompt), adapter)]


def test_a_killed_gateway_restarts(served, references, engine_kill):
    old = served.kill("gateway")
    served.wait_ready_again("gateway", old)
    wait_serving(served.gateway, timeout_s=60)
    assert "gateway was killed by SIGKILL; restarting it" in served.stderr
    assert _generate(served.gateway, PROMPTS[1], "a") == references["short"][(tuple(PROMPTS[1]), "a")]


def test_a_killed_control_plane_restarts_and_keeps_the_registry(served, references, engine_kill):
    old = served.kill("control")
    served.wait_ready_again("control", old)
    assert "control was killed by SIGKILL; restarting it" in served.stderr
    _wait_states(served, lambda s: s == ["serving"] * 2, timeout_s=60)
    with AdminClient(served.control) as admin:
        assert {a.name for a in admin.list()} == {"a", "solo1"}
        assert admin.get("solo1").replicas[1].placed
    assert _generate(served.gateway, PROMPTS[0], "solo1") == references["solo1"]
    assert served.proc.poll() is None


def test_a_crash_loop_stops_the_service_naming_the_process_and_its_log(files, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(files / "model", model)
    s = ServeProcess(tmp_path / "run", "--model", str(model), "--adapter-root",
                     str(files / "adapters"), "--device", "cpu", "--gateway-port", "0",
                     "--control-port", "0", "--http-port", "0", "--metrics-port", "-1",
                     "--shutdown-grace", "1", "--restart-backoff", "0.1",
                     "--crash-loop-deaths", "3", "--crash-loop-window", "120", *HEARTBEAT)
    try:
        s.wait_serving()
        os.rename(model, tmp_path / "model-gone")  # every start of the engine now fails
        s.kill("engine")
        assert s.proc.wait(180) == 1, s.stderr
    finally:
        s.stop()
    lines = s.stderr.splitlines()
    log = tmp_path / "run" / "engine.log"
    loop = [ln for ln in lines if "crash loop" in ln]
    assert loop == [f"loramux: engine died 3 times within 120 s (a crash loop); stopping. "
                    f"Its log: {log}"], lines
    assert sum("engine exited with status" in ln and "restarting it" in ln for ln in lines) == 1
    assert "model-gone" not in log.read_text(errors="replace")
    assert str(model) in log.read_text(errors="replace")  # why its starts failed
