"""`loramux serve --tensor-parallel-size 2` on the CPU: the three services come up with a
two-rank engine, an adapter loads through the admin API, and a generation streams the
same tokens as the in-process single-rank engine; Ctrl-C stops everything."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from loramux import AdminClient, GenerateClient

from loramux_engine import Engine, EngineConfig, SamplingParams
from loramux_services.launcher import free_port, wait_serving

ROOT = Path(__file__).resolve().parents[1]
# Services on CPU engines whatever LORAMUX_TEST_DEVICE says (two gloo ranks on one host):
# the served engines and the in-process reference alike (tests/conftest.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.engine_device("cpu")]


def test_serve_with_two_ranks(llama_family, tmp_path):
    ports = [free_port() for _ in range(4)]
    args = ["serve", "--model", str(llama_family.model_dir),
            "--adapter-root", str(llama_family.adapters["rs4"].parent),
            "--tensor-parallel-size", "2", "--device", "cpu", "--gateway-port", str(ports[0]),
            "--control-port", str(ports[1]), "--metrics-port", str(ports[2]),
            "--http-port", str(ports[3]),
            "--workdir", str(tmp_path / "run")]
    code = f"import sys; from loramux.cli import main; sys.exit(main({args!r}))"
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_serving(f"127.0.0.1:{ports[0]}", timeout_s=120)
        with AdminClient(f"127.0.0.1:{ports[1]}") as admin:
            admin.load("rs4", "rs4")
        with GenerateClient(f"127.0.0.1:{ports[0]}") as gen:
            got = gen.generate([5, 17, 33, 99], "rs4", max_tokens=8, temperature=0.0,
                               ignore_eos=True)
        with Engine(EngineConfig(model=str(llama_family.model_dir))) as offline:
            offline.add_adapter("rs4", llama_family.adapters["rs4"])
            want = offline.generate([[5, 17, 33, 99]], SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True), adapters=["rs4"])[0]
        assert got.token_ids == want.token_ids
        log = (tmp_path / "run" / "engine.log").read_text()
        assert "engine serving" in log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert proc.returncode == 0, out[-3000:]
