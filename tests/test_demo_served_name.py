"""`loramux serve` without --model serves the demo model under the name loramux-demo:
the official openai client lists that name (no path of this machine), and a completion
naming it is served by the base model."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import openai
import pytest

from loramux_services.launcher import free_port
from tests.test_openai_api import _health

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    ports = {name: free_port() for name in ("gateway", "control", "http")}
    cmd = [sys.executable, "-m", "loramux.cli", "serve", "--cache-dir", str(root / "cache"),
           "--device", "cpu", "--workdir", str(root / "run"), "--metrics-port", "-1",
           *(a for name, port in ports.items() for a in (f"--{name}-port", str(port)))]
    log = open(root / "serve.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    base = f"http://127.0.0.1:{ports['http']}"
    try:
        deadline = time.monotonic() + 180
        while _health(base) != 200:
            assert proc.poll() is None, (root / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the HTTP API did not come up"
            time.sleep(0.2)
        yield openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_demo_model_is_listed_and_served_by_name(demo):
    ids = [m.id for m in demo.models.list().data]
    assert ids[0] == "loramux-demo" and not any(os.sep in i for i in ids)
    out = demo.completions.create(model="loramux-demo", prompt="hello", max_tokens=4,
                                  temperature=0.0)
    assert out.model == "loramux-demo" and out.choices[0].finish_reason in ("length", "stop")
