"""`loramux serve` flags: one table per part (loramux_core/options.py), every EngineConfig
field a flag, every flag reaching the engine's resolved config, `--config FILE` (YAML or
TOML), and bad values refused in one line naming the flag, never a traceback."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from loramux_engine.config import EngineConfig
from loramux_engine.server import main as engine_main
from loramux_core.options import ENGINE_OPTIONS
from loramux_services.gateway import main as gateway_main
from loramux_services.launcher import Cluster
from loramux_services.serve_args import Plan, cluster_config, files, parse_args
from tests.support.serve_process import ENV
from tests.support.tiny import TinySpec, make_model

ROOT = Path(__file__).resolve().parents[1]
# a value other than the default for every engine option, as typed and as resolved
NON_DEFAULT = {
    "device": ("cpu", "cpu"), "dtype": ("bfloat16", "bfloat16"), "tp_size": ("1", 1),
    "max_loras": ("3", 3), "max_cpu_loras": ("5", 5), "max_lora_rank": ("32", 32),
    "max_num_seqs": ("7", 7), "max_num_batched_tokens": ("96", 96),
    "max_model_len": ("200", 200), "gpu_memory_utilization": ("0.5", 0.5),
    "num_kv_blocks": ("40", 40), "block_size": ("8", 8),
    "enable_prefix_caching": (None, False), "enforce_eager": (None, True),
    "async_scheduling": ("on", True), "cpu_threads": ("1", 1), "seed": ("7", 7), "load_format": ("dummy", "dummy"),
    "tp_allreduce": ("nccl", "nccl"), "adapter_loaders": ("0", 0),
    "host_reserve_loras": ("2", 2),
    "lora_extras": ("dora,lm_head", ("dora", "lm_head")),
}


def _flags(values=NON_DEFAULT) -> list[str]:
    out = []
    for o in ENGINE_OPTIONS:
        text, want = values[o.dest]
        out += o.argv(want) if text is None else [o.flag, text]
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_model(tmp_path_factory.mktemp("opts") / "model", TinySpec()))


def test_every_engine_config_field_is_a_flag():
    # model and adapter roots are shared with the control plane: their own flags
    fields = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "adapter_roots"}
    assert {o.dest for o in ENGINE_OPTIONS} == fields
    assert set(NON_DEFAULT) == fields
    for o in ENGINE_OPTIONS:
        assert "default" in o.help, o.flag  # --help says what happens when it is not given


def _planned(argv, tmp_path):
    args = parse_args(argv + ["--workdir", str(tmp_path)])
    return Cluster(cluster_config(args, files(args)))


def _sub_args(cmd: list[str]) -> list[str]:
    return cmd[cmd.index("-m") + 2:]


def test_every_flag_reaches_each_process_parser(model, tmp_path):
    """serve's flags -> the launcher's commands -> each process's own parser."""
    c = _planned(["--model", model, *_flags(), "--max-inflight", "9",
                  "--max-message-bytes", "5000", "--heartbeat-timeout", "4"], tmp_path)
    args = engine_main.build_parser().parse_args(_sub_args(c.command("engine")))
    got = engine_main.engine_config(args)
    for dest, (_, want) in NON_DEFAULT.items():
        assert getattr(got, dest) == want, dest
    gw = gateway_main.build_parser().parse_args(_sub_args(c.command("gateway")))
    vars(gw).update(gateway_main.given(gw, gateway_main.GATEWAY_OPTIONS))
    assert (gw.max_inflight, gw.max_message_bytes, gw.heartbeat_timeout) == (9, 5000, 4.0)
    control = c.command("control")
    assert control[control.index("--max-lora-rank") + 1] == "32"
    assert control[control.index("--heartbeat-timeout") + 1] == "4.0"


def test_nothing_given_forwards_nothing(model, tmp_path):
    """The processes' own defaults ("auto") decide what the user did not set."""
    c = _planned(["--model", model], tmp_path)
    args = engine_main.build_parser().parse_args(_sub_args(c.command("engine")))
    # only the adapter roots, which the engine shares with the control plane
    assert engine_main.engine_config(args, {}) == EngineConfig(
        model=model, adapter_roots=c.cfg.adapter_roots)
    assert c.cfg.gateway_args == () and c.cfg.control_args == ()


def test_the_base_model_is_served_under_a_name_not_a_path(model, tmp_path):
    """The demo model's HTTP name is loramux-demo, a user's model its directory's name,
    unless --served-model-name says otherwise (tests/test_openai_api.py: /v1/models)."""
    def served(argv, demo):
        args = parse_args(argv + ["--workdir", str(tmp_path)])
        c = Cluster(cluster_config(args, Plan(model, (model,), str(tmp_path), demo)))
        gw = gateway_main.build_parser().parse_args(_sub_args(c.command("gateway")))
        vars(gw).update(gateway_main.given(gw, gateway_main.GATEWAY_OPTIONS))
        return gw.served_model_name or gateway_main.served_name(gw.model)
    assert served([], demo=True) == "loramux-demo"
    assert served(["--served-model-name", "mine"], demo=True) == "mine"
    assert served(["--model", model], demo=False) == "model"
    assert gateway_main.served_name(model + "/") == "model"


@pytest.mark.parametrize("suffix", [".yaml", ".toml"])
def test_config_file(model, tmp_path, suffix):
    if suffix == ".yaml":
        text = "max_loras: 3\nmax-cpu-loras: 6\nenforce_eager: true\nasync_scheduling: off\n" \
               "tensor-parallel-size: 1\nmax_inflight: 12\nadapter_root: [/a, /b]\n"
    else:
        text = 'max_loras = 3\nmax-cpu-loras = 6\nenforce_eager = true\nasync_scheduling = "off"\n' \
               'tensor-parallel-size = 1\nmax_inflight = 12\nadapter_root = ["/a", "/b"]\n'
    cfg = tmp_path / f"serve{suffix}"
    cfg.write_text(text)
    args = parse_args(["--config", str(cfg), "--model", model, "--max-cpu-loras", "8"])
    assert args.engine == {"max_loras": 3, "max_cpu_loras": 8, "enforce_eager": True,
                           "async_scheduling": False, "tp_size": 1}  # the flag won
    assert args.gateway == {"max_inflight": 12} and args.adapter_root == ["/a", "/b"]


def _serve_cli(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    # what PYTHONPATH had first (a bare checkout's names, wheels carried beside it)
    return subprocess.run([sys.executable, "-m", "loramux.cli", *argv], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          env={**ENV, **(env or {})})


def _one_line_error(proc, *words, code=2):
    assert proc.returncode == code, proc
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_bad_values_are_one_line_naming_the_flag(tmp_path, capsys):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("max_loras: many\n")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("max_lora = 3\n")
    broken = tmp_path / "broken.toml"
    broken.write_text("max_loras = = 3\n")
    for argv, flag in [
        (["--max-loras", "0"], "--max-loras"),
        (["--gpu-memory-utilization", "2"], "--gpu-memory-utilization"),
        (["--max-loras", "8", "--max-cpu-loras", "2"], "--max-cpu-loras"),
        (["--dtype", "fp4"], "--dtype"),
        (["--async-scheduling", "maybe"], "--async-scheduling"),
        (["--lora-extras", "dora,bias"], "--lora-extras"),
        (["--max-inflight", "x"], "--max-inflight"),
        (["--metrics-port", "-2"], "--metrics-port"),
        (["--config", str(bad_yaml)], "max_loras"),
        (["--config", str(unknown)], "max_lora"),
        (["--config", str(broken)], "TOML"),
        (["--config", str(tmp_path / "missing.yaml")], "missing.yaml"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and flag in err, (argv, err)
    from loramux_services.control import main as control_main
    for parser, argv, flag in [
        (engine_main.build_parser(), ["--block-size", "0"], "--block-size"),
        (engine_main.build_parser(), ["--shutdown-grace", "-1"], "--shutdown-grace"),
        (gateway_main.build_parser(), ["--heartbeat-timeout", "nan"], "--heartbeat-timeout"),
        (control_main.build_parser(), ["--max-lora-rank", "0"], "--max-lora-rank"),
    ]:
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and flag in err, (argv, err)
    # end to end through the `loramux` command, and the client commands too
    for argv, flag in [(["serve", "--max-loras", "0"], "--max-loras"),
                       (["generate", "--seed", "-1", "hi"], "--seed"),
                       (["generate", "--max-tokens", "0", "hi"], "--max-tokens"),
                       (["generate", "--top-p", "1.5", "hi"], "--top-p"),
                       (["adapters", "list", "--page-size", "-1"], "--page-size")]:
        _one_line_error(_serve_cli(*argv), flag)


def test_serve_help_through_the_sdk_command():
    """`loramux serve` hands over to the server's launcher (same process); every flag's
    help renders (a bare % in one once broke --help)."""
    proc = _serve_cli("serve", "--help")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: loramux serve")
    assert "as many as 40% of the GPU memory" in " ".join(proc.stdout.split())
    for flag in ("--max-loras", "--replicas", "--gateway-port", "--config"):
        assert flag in proc.stdout, flag


def test_engine_server_bad_environment_is_one_line(model):
    proc = subprocess.run(
        [sys.executable, "-m", "loramux_engine.server", "--model", model, "--input", "tcp://127.0.0.1:1",
         "--output", "tcp://127.0.0.1:2", "--insecure-zmq"], cwd=ROOT, capture_output=True,
        text=True, timeout=120, env={**ENV, "LORAMUX_MAX_LORAS": "lots"})
    _one_line_error(proc, "LORAMUX_MAX_LORAS", "--max-loras")


def test_serve_reports_an_engine_that_cannot_start_in_one_line(model, tmp_path):
    proc = _serve_cli("serve", "--model", model, "--gateway-port", "0", "--control-port", "0",
                      "--metrics-port", "-1", "--http-port", "0", "--workdir", str(tmp_path),
                      env={"LORAMUX_MAX_LORAS": "lots", "OMP_NUM_THREADS": "1"})
    _one_line_error(proc, "engine exited", "LORAMUX_MAX_LORAS", "--max-loras", code=1)


def test_resolved_config_of_a_real_engine(model, tmp_path):
    """The engine process started from serve's flags reports every field as given."""
    c = _planned(["--model", model, *_flags()], tmp_path)
    c.cfg.env["OMP_NUM_THREADS"] = "1"
    c.start("engine")
    try:
        ready = c.wait_ready("engine")["engine"]
    finally:
        c.close()
    got = ready["config"]
    for dest, (_, want) in NON_DEFAULT.items():   # (JSON has lists, not tuples)
        assert got[dest] == (list(want) if isinstance(want, tuple) else want), (dest, got[dest])
    assert json.loads(json.dumps(got))["model"] == model
