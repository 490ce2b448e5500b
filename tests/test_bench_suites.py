"""benchmarks/suite.py: one command line for every suite. The shared flags (--out, --tiny,
--device) become each case's own options or a precise refusal; every case names a module
that exists; and the GPU round scripts call only suites and cases that exist, with
options the case parses (tp_round.sh once passed lengths bench_replicas.py refused)."""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shlex
from pathlib import Path

import pytest

from benchmarks.serving.workload import parse_lengths
from benchmarks.suite import UsageError, main, plan

REPO = Path(__file__).resolve().parents[1]
SUITES = ("decode", "kernels", "adapters", "parallel", "models", "serving")


def _cases(suite: str) -> dict:
    name = "benchmarks.serving.__main__" if suite == "serving" else f"benchmarks.{suite}"
    return importlib.import_module(name).CASES


@pytest.mark.parametrize("suite", SUITES)
def test_every_case_names_a_module(suite):
    for name, case in _cases(suite).items():
        assert importlib.util.find_spec(case.module) is not None, (suite, name)
        assert re.fullmatch(r"[a-z][a-z0-9-]*", name)


def test_shared_flags_become_the_case_options():
    cases = _cases("parallel")
    assert plan(cases, ["--out", "D", "--tp", "2"]) == (
        "decode", cases["decode"], Path("D"), ["decode", "--out", "D", "--tp", "2"])
    _, _, _, argv = plan(cases, ["decode", "--tiny", "--out", "D", "--steps", "2"])
    assert argv == ["decode", "--out", "D", "--device", "cpu", "--steps", "2"]
    _, _, _, argv = plan(cases, ["replicas", "--out", "D", "--tiny", "--input-len", "8-32"])
    assert argv == ["--out", "D", "--tiny", "--input-len", "8-32"]
    # what follows a bare "--" is the case's, even a flag the suite itself knows
    serving = _cases("serving")
    _, _, _, argv = plan(serving, ["--tiny", "--out", "D", "--rate", "4", "--", "--device",
                                   "cpu", "--max-loras", "2"])
    assert argv == ["--out", "D", "--tiny", "--rate", "4", "--", "--device", "cpu",
                    "--max-loras", "2"]
    # a case option that starts like a shared one is not taken for it
    _, _, _, argv = plan(serving, ["--out", "D", "--output-len", "4"])
    assert argv == ["--out", "D", "--output-len", "4"]
    _, _, _, argv = plan(_cases("decode"), ["prefill", "--out", "D", "--device", "cpu"])
    assert argv == ["--out", "D", "--device", "cpu"]
    # a CUDA-only case takes --device cuda (nothing to pass) and refuses the CPU
    _, _, _, argv = plan(_cases("decode"), ["--out", "D", "--device", "cuda", "--no-hf"])
    assert argv == ["--out", "D", "--no-hf"]


@pytest.mark.parametrize("argv, says", [
    (["--tiny", "--out", "D"], "case 'decode' has no --tiny mode"),
    (["--out", "D", "--device", "cpu"], "case 'decode' runs on cuda, not 'cpu'"),
    (["prefil", "--out", "D"], "unknown case 'prefil'; cases: decode, prefill"),
    (["prefill", "--tiny"], "--out DIR is required"),
    (["--out", "D", "--device", "cuda:1"], "case 'decode' takes no device index; choose"),
])
def test_refusals_are_precise(argv, says, capsys):
    with pytest.raises(UsageError, match=re.escape(says)):
        plan(_cases("decode"), argv)
    assert main("decode", _cases("decode"), argv) == 2
    assert says in capsys.readouterr().err


def _suite_calls(script: Path) -> list[list[str]]:
    """Each `python3 -m benchmarks.SUITE ...` of a round script, as words, with the script's
    variables for the suite command ($B, $DEC) put back and line continuations joined."""
    text = script.read_text().replace("\\\n", " ")
    names: dict[str, str] = {}
    for var, value in re.findall(r'^(\w+)="([^"]*)"', text, re.M):
        for known, command in names.items():
            value = re.sub(rf"\${known}\b", command, value)
        if value.startswith("python3 -m benchmarks."):
            names[var] = value
    calls = []
    for line in text.splitlines():
        if line.lstrip().startswith("#") or re.match(r'\s*\w+="', line):  # comment, definition
            continue
        for var, value in names.items():
            line = re.sub(rf"\${var}\b", value, line)
        for m in re.finditer(r"python3 -m (benchmarks\.\w+)(.*)", line):
            words = shlex.split(m.group(2).split(">")[0].split("|")[0], posix=True)
            calls.append([m.group(1), *words])
    return calls


def test_round_scripts_call_suites_with_options_their_cases_parse():
    seen = set()
    for script in sorted((REPO / "benchmarks").glob("*.sh")):
        text = script.read_text()
        assert not re.search(r"python3? benchmarks/\w+\.py", text), f"{script.name}: use a suite"
        for call in _suite_calls(script):
            suite = call[0].removeprefix("benchmarks.")
            assert suite in SUITES, (script.name, call)
            cases = _cases(suite)
            case = call[1] if len(call) > 1 and not call[1].startswith("-") else next(iter(cases))
            assert case in cases, (script.name, call)
            seen.add((suite, case))
            for flag, value in zip(call, call[1:]):
                if flag in ("--input-len", "--output-len") and not value.startswith("$"):
                    parse_lengths(value)  # raises on what the case would refuse
    assert {("decode", "decode"), ("decode", "prefill"), ("kernels", "lora"),
            ("serving", "run"), ("parallel", "decode"), ("parallel", "replicas"),
            ("parallel", "allreduce"), ("parallel", "table"), ("models", "moe"),
            ("models", "fp8")} <= seen


def test_host_heap_benchmark_compares_both_layouts(tmp_path):
    from benchmarks.bench_host_heap import main as heap

    assert heap(["--out", str(tmp_path), "--copies", "20"]) == 0
    rows = json.loads((tmp_path / "host-heap.json").read_text())["rows"]
    before, after = rows["per layer (before)"], rows["on demand (LayerGroups)"]
    assert before["tracked_per_copy"] > 10 * after["tracked_per_copy"] > 0
