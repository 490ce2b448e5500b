"""A port the configuration fixes and another process holds: `loramux serve` stops before
anything slow (the demo model, an engine's warm-up) with one line naming the flag and the
port; the gateway and the control plane, started alone on a taken port, say the flag and
the address in one line instead of a traceback. Real processes, real sockets on loopback."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from loramux_services.launcher import free_port
from tests.support.serve_process import ENV, ROOT
from tests.support.tiny import TinySpec, make_model

pytestmark = pytest.mark.timeout(300)
FLAGS = ("--gateway-port", "--control-port", "--http-port", "--metrics-port")


@pytest.fixture
def taken():
    """A port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _run(*argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s, env=ENV)


def _one_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode not in (0, None), proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("flag", FLAGS)
def test_serve_names_a_taken_port_before_reading_the_model(flag, taken, tmp_path):
    # a model that is not there: serve would fail on it (in an engine, after start) had it
    # got that far; the others fixed to free ports, so only `flag`'s is taken
    ports = {f: free_port() for f in FLAGS} | {flag: taken}
    argv = [a for f, p in ports.items() for a in (f, str(p))]
    proc = _run("-m", "loramux.cli", "serve", "--model", str(tmp_path / "no-model"),
                "--workdir", str(tmp_path / "run"), *argv)
    assert proc.returncode == 1
    assert _one_line(proc) == (f"loramux: {flag} {taken} is already in use (another process "
                               f"is listening on 127.0.0.1:{taken})")
    assert not (tmp_path / "run").exists()  # no process was started


def test_the_demo_model_is_not_made_when_a_port_is_taken(taken, tmp_path):
    proc = _run("-m", "loramux.cli", "serve", "--http-port", str(taken), "--cache-dir",
                str(tmp_path / "cache"))
    assert f"--http-port {taken} is already in use" in _one_line(proc)
    assert not (tmp_path / "cache").exists()


def test_two_flags_on_one_port(tmp_path):
    port = free_port()
    proc = _run("-m", "loramux.cli", "serve", "--model", str(tmp_path), "--gateway-port",
                str(port), "--http-port", str(port))
    assert _one_line(proc) == (f"loramux: --http-port {port} is also --gateway-port's port: "
                               "give each its own")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("ports") / "model", TinySpec()))


def _links() -> list[str]:
    return ["--engine-input", f"tcp://127.0.0.1:{free_port()}", "--engine-output",
            f"tcp://127.0.0.1:{free_port()}", "--insecure-zmq"]


def test_control_plane_names_its_taken_listen_port(model, taken, tmp_path):
    proc = _run("-m", "loramux_services.control", "--model", model, "--adapter-root", model,
                "--db", str(tmp_path / "r.sqlite"), "--table-address",
                f"tcp://127.0.0.1:{free_port()}", "--listen", f"127.0.0.1:{taken}", *_links())
    assert proc.returncode == 2
    line = _one_line_of_errors(proc)
    assert line.startswith(f"error: --listen: cannot listen on 127.0.0.1:{taken}: "
                           "Address already in use"), line


@pytest.mark.parametrize("flag", ["--listen", "--http-port", "--metrics-port"])
def test_gateway_names_its_taken_port(flag, model, taken):
    ports = {"--listen": f"127.0.0.1:{free_port()}", "--http-port": str(free_port()),
             "--metrics-port": str(free_port())}
    ports[flag] = f"127.0.0.1:{taken}" if flag == "--listen" else str(taken)
    proc = _run("-m", "loramux_services.gateway", "--model", model, "--table-address",
                f"tcp://127.0.0.1:{free_port()}", *_links(),
                *[a for f, v in ports.items() for a in (f, v)])
    assert proc.returncode == 2
    line = _one_line_of_errors(proc)
    assert line.startswith(f"error: {flag}: cannot listen on ") and f":{taken}: " in line, line


def _one_line_of_errors(proc: subprocess.CompletedProcess) -> str:
    """The services log their start as JSON lines on stderr; the error is one plain line."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr
    return errors[0]
