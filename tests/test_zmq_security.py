"""The engine's and the control plane's ZMQ sockets admit only the run's own processes
(CURVE keys made by the launcher, a ZAP authenticator in each binding process).

Unit checks of the key directory, the refusal to start without keys, and a rogue local
process against a real cluster: without the keys it can neither load nor pin nor unload an
adapter, nor run a request, nor read a byte of the engine's output or the adapter table,
and the service's outputs stay identical; the same process with the run's keys (the
positive control) does get through, so the checks can fail."""
from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from loramux import AdminClient, GenerateClient

from loramux_core import curve
from loramux_core.probe import wait_output
from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

REPO = Path(__file__).resolve().parents[1]
TOKEN = "zmq-test-token"


# ---- the key directory -------------------------------------------------------------

def test_generated_keys_are_private_and_load(tmp_path):
    keys = curve.generate_keys(tmp_path / "keys")
    d = Path(keys.directory)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    for name in ("server", "client"):
        assert stat.S_IMODE((d / f"{name}.key_secret").stat().st_mode) == 0o600
    again = curve.ZmqKeys.load(d)
    assert again == keys and len({keys.server_public, keys.client_public}) == 2
    fresh = curve.generate_keys(tmp_path / "keys")  # per run: new keys every time
    assert fresh.server_secret != keys.server_secret and fresh.client_secret != keys.client_secret


def test_keys_readable_by_others_or_missing_are_refused(tmp_path):
    keys = curve.generate_keys(tmp_path / "keys")
    os.chmod(Path(keys.directory) / "client.key_secret", 0o644)
    with pytest.raises(curve.ZmqKeyError, match="must be 0600"):
        curve.ZmqKeys.load(keys.directory)
    os.unlink(Path(keys.directory) / "client.key_secret")
    with pytest.raises(curve.ZmqKeyError, match="no client.key_secret"):
        curve.ZmqKeys.load(keys.directory)
    with pytest.raises(curve.ZmqKeyError, match="does not exist"):
        curve.ZmqKeys.load(tmp_path / "nowhere")


def test_keygen_keep(tmp_path):
    run = [sys.executable, "-m", "loramux_core.curve", "--keep", str(tmp_path / "k")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(run, check=True, env=env, cwd=REPO, capture_output=True)
    first = curve.ZmqKeys.load(tmp_path / "k")
    subprocess.run(run, check=True, env=env, cwd=REPO, capture_output=True)
    assert curve.ZmqKeys.load(tmp_path / "k") == first
    subprocess.run(run[:3] + run[4:], check=True, env=env, cwd=REPO, capture_output=True)
    assert curve.ZmqKeys.load(tmp_path / "k").server_secret != first.server_secret


@pytest.mark.parametrize("module,extra", [
    ("loramux_engine.server", ["--input", "tcp://127.0.0.1:1", "--output", "tcp://127.0.0.1:2"]),
    ("loramux_services.control", ["--engine-input", "tcp://127.0.0.1:1", "--engine-output",
                          "tcp://127.0.0.1:2", "--table-address", "tcp://127.0.0.1:3",
                          "--db", "unused.sqlite", "--adapter-root", "."]),
    ("loramux_services.gateway", ["--engine-input", "tcp://127.0.0.1:1", "--engine-output",
                          "tcp://127.0.0.1:2", "--table-address", "tcp://127.0.0.1:3"]),
])
def test_services_refuse_to_start_without_keys(module, extra, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (curve.KEYS_ENV, curve.INSECURE_ENV)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", module, "--model", str(tmp_path), *extra]
    out = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "no ZMQ keys" in out.stderr and "--insecure-zmq" in out.stderr
    assert not (tmp_path / "unused.sqlite").exists()


# ---- a rogue local process against a real cluster ---------------------------------------

@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("zmq")
    model = make_model(root / "model", TinySpec())
    for i, name in enumerate(("a1", "a2"), start=1):
        make_adapter(root / "adapters" / name, model, AdapterSpec(seed=40 + i))
    outside = make_adapter(root / "outside" / "evil", model, AdapterSpec(seed=66))
    return {"root": root, "model": str(model), "adapters": str(root / "adapters"),
            "outside": str(outside)}


@pytest.fixture(scope="module")
def cluster(files):
    cfg = ClusterConfig(model=files["model"], adapter_roots=(files["adapters"],),
                        workdir=str(files["root"] / "run"), auth_token=TOKEN,
                        env={"OMP_NUM_THREADS": "1"})
    with Cluster(cfg) as c:
        c.start()
        c.wait_ready()
        wait_serving(c.gateway_address)
        with AdminClient(c.control_address, token=TOKEN) as admin:
            admin.load("a1", "a1")
            admin.load("a2", "a2", pinned=True)
        yield c


def rogue(cluster, files, mode: str, seconds: float) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tests.support.rogue_zmq", "--as", mode,
           "--engine-input", cluster.engine_input, "--engine-output", cluster.engine_output,
           "--table", cluster.table_address,  # z85 may start with '-': one argument
           f"--server-public={cluster.zmq_keys.server_public.decode()}", "--outside", files["outside"],
           "--served", "a1", "--seconds", str(seconds)]
    if mode == "member":
        cmd += ["--zmq-keys", cluster.zmq_keys.directory]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def report(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def snapshot(cluster) -> tuple:
    with AdminClient(cluster.control_address, token=TOKEN) as admin:
        adapters = {a.name: (a.state, a.pinned, a.id, a.path) for a in admin.list()}
    with GenerateClient(cluster.gateway_address) as gen:
        tokens = [gen.generate("the quick brown fox", name, temperature=0.0, max_tokens=8,
                               ignore_eos=True).token_ids for name in ("a1", "a2", None)]
    return adapters, tokens


def long_stream(cluster) -> list[int]:
    with GenerateClient(cluster.gateway_address) as gen:
        return gen.generate("once upon a time", "a1", temperature=0.0, max_tokens=96,
                            ignore_eos=True).token_ids


@pytest.mark.timeout(300)
def test_rogue_local_process_gets_nothing_and_changes_nothing(cluster, files):
    before = snapshot(cluster)
    want_long = long_stream(cluster)
    seen: list = []
    with ThreadPoolExecutor(1) as pool:
        during = pool.submit(long_stream, cluster)  # a stream that runs through the attack
        rogues = [rogue(cluster, files, mode, seconds=3.0) for mode in ("plain", "stranger")]
        cluster.wait_output(lambda m: False, 4.0, last=seen)  # the engine's output meanwhile
        reports = {mode: report(p) for mode, p in zip(("plain", "stranger"), rogues)}
        assert during.result(timeout=120) == want_long
    for mode, got in reports.items():
        assert got["sent"] > 0, (mode, got)
        assert (got["output"], got["table"], got["acks"]) == (0, 0, []), (mode, got)
    acks = [m.adapter_ack.command_id for m in seen if m.WhichOneof("kind") == "adapter_ack"]
    assert not [a for a in acks if a.startswith("rogue")], acks
    rogue_rows = [d.request_id for m in seen if m.WhichOneof("kind") == "step_batch"
                  for d in (*m.step_batch.deltas, *m.step_batch.errors)
                  if d.request_id == "rogue-gen"]
    assert rogue_rows == []
    events = [m.event for m in seen if m.WhichOneof("kind") == "event"]
    assert events, "the engine published no event while observed with the run's keys"
    assert {a.name: a.pinned for a in events[-1].adapters} == {"a1": False, "a2": True}
    assert snapshot(cluster) == before
    assert cluster.dead() == []


@pytest.mark.timeout(300)
def test_the_same_process_with_the_run_keys_gets_through(cluster, files):
    """Positive control: the rogue's sockets and checks work; only the keys are missing."""
    # it stops once it saw all three: the window only bounds a failure
    got = report(rogue(cluster, files, "member", seconds=60.0))
    assert got["output"] > 0 and got["table"] > 0, got
    assert "member-pin" in got["acks"], got


def test_reading_without_the_keys_fails_loudly(cluster):
    """A test or tool that forgets the keys is told so at once, not left to time out."""
    t0 = time.monotonic()
    with pytest.raises(curve.ZmqKeyError, match="refused the handshake.*no CURVE keys"):
        wait_output(cluster.engine_output, lambda m: True, 60)
    assert time.monotonic() - t0 < 30  # at the handshake, far from the 60 s timeout
