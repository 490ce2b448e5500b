"""An engine server is seen while it starts: a real `python -m loramux_engine.server` process
binds its sockets and heartbeats before it loads the weights, with its phase (LOADING,
WARMING_UP, then SERVING), what it does, how far it is and an estimate of what is left;
its ready file appears only once a heartbeat has said SERVING. A request and an adapter
command sent while it still warms up wait in its input queue and are answered once it
serves; its stderr shows the progress lines and the warm-up's report.

On the CPU the warm-up has nothing to compile: the hidden --debug-warm-up runs it all the
same (real eager steps through the torch references), so that it lasts long enough to
be watched."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from loramux_core.v1 import engine_pb2
from loramux_services.launcher import free_port
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

REPO = Path(__file__).resolve().parents[1]
PHASE = engine_pb2.EnginePhase
pytestmark = [pytest.mark.timeout(300)]


def start_engine(tmp_path: Path, model: Path, adapters: Path):
    inp, out = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ready = tmp_path / "ready.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "loramux_engine.server", "--model", str(model), "--input", inp,
           "--output", out, "--insecure-zmq", "--device", "cpu", "--adapter-root",
           str(adapters), "--heartbeat-interval", "0.02", "--debug-warm-up",
           "--max-num-batched-tokens", "16", "--max-num-seqs", "3", "--max-model-len", "40",
           "--ready-file", str(ready)]
    log = open(tmp_path / "engine.log", "w")
    proc = subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    return proc, inp, out, ready


def test_heartbeats_show_the_start_before_the_ready_file(tmp_path):
    model = make_model(tmp_path / "model", TinySpec())
    adapter = make_adapter(tmp_path / "adapters" / "a1", model, AdapterSpec(seed=41))
    ctx = zmq.Context.instance()
    sub, push = ctx.socket(zmq.SUB), ctx.socket(zmq.PUSH)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    for sock in (sub, push):
        sock.setsockopt(zmq.LINGER, 0)
    proc, inp, out, ready = start_engine(tmp_path, model, tmp_path / "adapters")
    sub.connect(out)
    push.connect(inp)
    beats, sent, acks, deltas = [], False, [], []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not (acks and deltas and deltas[-1].finished):
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()[-3000:]
            if not sub.poll(50):
                continue
            msg = engine_pb2.EngineOutput.FromString(sub.recv())
            kind = msg.WhichOneof("kind")
            if kind == "heartbeat":
                beats.append((msg.heartbeat, ready.exists()))
                if not sent and msg.heartbeat.phase == PHASE.Value("ENGINE_PHASE_WARMING_UP"):
                    _send_work(push, adapter)   # arrives while it warms up
                    sent = True
            elif kind == "adapter_ack":
                acks.append(msg.adapter_ack)
            elif kind == "step_batch":
                deltas += [d for d in msg.step_batch.deltas if d.request_id == "early"]
                assert not msg.step_batch.errors, msg.step_batch.errors
    finally:
        proc.terminate()
        proc.wait(30)
        sub.close(0)
        push.close(0)
    log = (tmp_path / "engine.log").read_text()
    phases = [hb.phase for hb, _ in beats]
    serving = PHASE.Value("ENGINE_PHASE_SERVING")
    assert serving in phases, log[-3000:]
    first_serving = phases.index(serving)
    starting = beats[:first_serving]
    # every heartbeat before SERVING was sent while the ready file did not exist yet
    assert starting and not any(seen_ready for _, seen_ready in starting)
    # LOADING, then WARMING_UP (the subscriber may join after the few beats of a tiny
    # model's load: the log line says the phase was entered)
    loading, warming_up = PHASE.Value("ENGINE_PHASE_LOADING"), PHASE.Value("ENGINE_PHASE_WARMING_UP")
    assert set(phases[:first_serving]) <= {loading, warming_up}
    assert phases[:first_serving] == sorted(phases[:first_serving]) and warming_up in phases
    assert log.index("engine loading: ") < log.index("engine warm-up: ")
    warming = [hb for hb, _ in starting if hb.phase == PHASE.Value("ENGINE_PHASE_WARMING_UP")]
    progress = [hb.phase_progress for hb in warming]
    assert progress == sorted(progress) and len(set(progress)) >= 3, progress
    assert any(hb.phase_eta_s > 0 for hb in warming)
    assert any(hb.phase_detail.startswith("compiling eager step ") for hb in warming)
    assert all(p == serving for p in phases[first_serving:])   # it never goes back
    assert [hb.max_model_len for hb, _ in beats][-1] == 40
    # the work sent while it warmed up was done once it served
    assert sent and len(acks) == 1 and acks[0].ok, acks
    assert sum(len(d.token_ids) for d in deltas) == 4 and deltas[-1].finished
    assert "engine warm-up: compiling eager step" in log
    assert "eager step shapes (2 layers each)" in log


def _send_work(push, adapter: Path) -> None:
    load = engine_pb2.AdapterCommand(command_id="c1", name="a1", path=str(adapter),
                                     kind=engine_pb2.ADAPTER_COMMAND_KIND_LOAD)
    push.send(engine_pb2.EngineInput(adapter_command=load).SerializeToString())
    req = engine_pb2.EngineGenerate(request_id="early", prompt_token_ids=[5, 6, 7])
    req.sampling.max_tokens, req.sampling.temperature, req.sampling.ignore_eos = 4, 0.0, True
    push.send(engine_pb2.EngineInput(generate=req).SerializeToString())
