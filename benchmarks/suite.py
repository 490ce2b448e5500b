"""One command line for every benchmark suite:

    python -m benchmarks.SUITE [CASE] --out DIR [--tiny] [--device DEVICE] [case options]

SUITE is one of decode, kernels, adapters, serving, parallel, models; CASE one of the
suite's cases (its first when left out; `--list` names them). --out, --tiny and --device
mean the same in every case: results go under DIR, --tiny is the case's small CPU run (a
check of the script, not a measurement), --device the device it measures. Everything
else goes to the case's own options (`python -m benchmarks.SUITE CASE --help`).

Each case writes its JSON under DIR and prints its table; the suite adds
DIR/run-SUITE-CASE.json (the command, the commit, the exit status, seconds and the files
the case wrote), written before the case starts and again when it ends, so that a run cut
off by a time limit still says what ran. Cases run in this process (runpy), so signals
sent to the command reach the benchmark, which stops its services on the way out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    """One benchmark of a suite: the module that runs it and what the shared flags mean."""
    module: str                       # e.g. "benchmarks.bench_decode"
    about: str                        # one line for --list
    args: tuple[str, ...] = ()        # put before the user's options (a subcommand)
    tiny: tuple[str, ...] | None = None   # what --tiny becomes; None: no tiny mode
    devices: tuple[str, ...] = ("cuda",)  # what it can measure on
    device_flag: bool = False         # the module takes --device itself


class UsageError(Exception):
    """A command line the suite refuses (exit status 2)."""


def plan(cases: dict[str, Case], argv: list[str]) -> tuple[str, Case, Path, list[str]]:
    """(case name, case, out dir, the module's argv) for a suite command line."""
    argv = list(argv)
    name = argv.pop(0) if argv and not argv[0].startswith("-") else next(iter(cases))
    if name not in cases:
        raise UsageError(f"unknown case {name!r}; cases: {', '.join(cases)}")
    case = cases[name]
    # options after a bare "--" belong to the case (bench_serving: `loramux serve`'s flags)
    cut = argv.index("--") if "--" in argv else len(argv)
    shared = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    shared.add_argument("--out")
    shared.add_argument("--tiny", action="store_true")
    shared.add_argument("--device")
    known, rest = shared.parse_known_args(argv[:cut])
    rest += argv[cut:]
    if not known.out:
        raise UsageError("--out DIR is required")
    extra: list[str] = []
    if known.tiny:
        if case.tiny is None:
            raise UsageError(f"case {name!r} has no --tiny mode (it measures on "
                             f"{'/'.join(case.devices)} only)")
        extra += case.tiny
    if known.device:
        if known.device.split(":")[0] not in case.devices:
            raise UsageError(f"case {name!r} runs on {'/'.join(case.devices)}, "
                             f"not {known.device!r}")
        if case.device_flag:
            extra += ["--device", known.device]
        elif known.device not in case.devices:  # it would run on the default device
            raise UsageError(f"case {name!r} takes no device index; choose the GPU with "
                             "CUDA_VISIBLE_DEVICES")
    out = Path(known.out)
    return name, case, out, [*case.args, "--out", str(out), *extra, *rest]


def usage(suite: str, cases: dict[str, Case]) -> str:
    lines = [f"python -m benchmarks.{suite} [CASE] --out DIR [--tiny] [--device DEVICE] "
             "[case options]", "cases (the first is the default):"]
    for name, case in cases.items():
        tiny = "" if case.tiny is None else ", --tiny"
        lines.append(f"  {name:<12} {case.about} [{'/'.join(case.devices)}{tiny}; "
                     f"{case.module}]")
    return "\n".join(lines)


def main(suite: str, cases: dict[str, Case], argv: list[str] | None = None) -> int:
    """Run one case of `suite`; returns its exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "--list"):
        print(usage(suite, cases))
        return 0 if argv else 2
    if argv[0] in cases and ("-h" in argv or "--help" in argv):  # the case's own options
        return run_module(cases[argv[0]].module, [*cases[argv[0]].args, "--help"])
    try:
        name, case, out, case_argv = plan(cases, argv)
    except UsageError as e:
        print(f"benchmarks.{suite}: {e}\n{usage(suite, cases)}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    record_path = out / f"run-{suite}-{name}.json"
    before = _files(out)
    record = {"suite": suite, "case": name, "module": case.module,
              "command": ["python", "-m", f"benchmarks.{suite}", *argv],
              "commit": commit(), "started": _now(), "rc": None}
    record_path.write_text(json.dumps(record, indent=2))
    t0 = time.monotonic()
    rc = run_module(case.module, case_argv)
    record.update(rc=rc, seconds=round(time.monotonic() - t0, 1),
                  files=[f for f, m in sorted(_files(out).items())
                         if before.get(f) != m and f != record_path.name])
    record_path.write_text(json.dumps(record, indent=2))
    print(f"benchmarks.{suite} {name}: rc={rc} in {record['seconds']} s at {record['commit']}; "
          f"{len(record['files'])} files under {out}", flush=True)
    return rc


def run_module(module: str, argv: list[str]) -> int:
    """Run `module` as `python -m module argv...` would, in this process."""
    saved = sys.argv
    sys.argv = [module, *argv]
    try:
        with warnings.catch_warnings():
            # a fresh copy runs as __main__ even where the module was imported before
            # (a test that also imports it): that is the point, not a hazard
            warnings.filterwarnings("ignore", "'benchmarks", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved


def commit() -> str:
    """The commit measured: LORAMUX_COMMIT where a copy of the tree has no git history."""
    if os.environ.get("LORAMUX_COMMIT"):
        return os.environ["LORAMUX_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, text=True,
                              capture_output=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns
            for p in root.rglob("*") if p.is_file()}


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
