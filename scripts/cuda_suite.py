"""The whole test suite with every in-process Engine on CUDA (LORAMUX_TEST_DEVICE=cuda, see
tests/conftest.py), within one time limit, on one GPU machine.

    python3 scripts/cuda_suite.py --out DIR [--limit 540] [--workers 8] [--files-from FILE]

Each test file is one pytest process; WORKERS of them run side by side, taking files from
one queue, longest first (by an earlier run's summary given as --order-from, else by size:
the long ones start early, the small ones fill the tail). At the limit the running files
get SIGINT (pytest still prints its summary) and nothing new starts. Files not finished
are written to DIR/remaining.txt: `--files-from DIR/remaining.txt` runs them in a next call
on the same machine, reusing the one Triton cache. The logs of files that did not pass are
in DIR/failed.txt (the last 40,000 characters of each); the summary (one line per file,
then every FAILED/ERROR line) ends the output and is saved as DIR/summary.txt. Exit status
0 only when every file ran and passed.

Expected skips: TP tests on one GPU, test_warmup's launch-key checks (the CPU model), test_tls
where the `cryptography` package is missing (pytest exits 5 for a file skipped whole: a pass).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# pytest's exit status when a file collects no test: a module skipped whole (e.g. test_tls
# without the `cryptography` package) is a skip, not a failure
NO_TESTS = 5
SUMMARY = re.compile(r"^=* ?(\d+ (?:passed|failed|error|skipped|deselected).*?|no tests ran)"
                     r" in [\d.]+s", re.M)


def _names() -> str:
    """"" where loramux is installed; else the PYTHONPATH that imports the checkout by its
    own names (scripts/checkout_path.sh)."""
    if importlib.util.find_spec("loramux_engine") and importlib.util.find_spec("loramux"):
        return ""
    return subprocess.run(["bash", str(ROOT / "scripts/checkout_path.sh")], check=True,
                          capture_output=True, text=True).stdout.strip()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--limit", type=float, default=540.0, help="seconds for the whole run")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--files-from", type=Path, help="test files, one per line")
    p.add_argument("--device", default="cuda", help="LORAMUX_TEST_DEVICE")
    p.add_argument("--order-from", type=Path,
                   help="an earlier summary.txt: files start longest first by its times")
    a = p.parse_args(argv)
    logs = a.out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    if a.files_from:
        files = [ln.strip() for ln in a.files_from.read_text().splitlines() if ln.strip()]
    else:
        files = [str(f.relative_to(ROOT)) for f in (ROOT / "tests").glob("test_*.py")]
    # seconds each file took before; a file not timed yet counts one second per kB
    took = {}
    if a.order_from and a.order_from.exists():
        for m in re.finditer(r"^(\S+\.py)\s+rc=\S+\s+(\d+)s", a.order_from.read_text(), re.M):
            took[m.group(1)] = int(m.group(2))
    files.sort(key=lambda f: -took.get(f, (ROOT / f).stat().st_size / 1000))
    env = dict(os.environ, LORAMUX_TEST_DEVICE=a.device, PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "2"),
               TRITON_CACHE_DIR=os.environ.get("TRITON_CACHE_DIR", "/tmp/loramux-triton"),
               PYTHONPATH=os.pathsep.join(filter(None, [_names(), os.environ.get("PYTHONPATH")])))
    queue, running, done, interrupted = deque(files), {}, {}, set()
    start = time.monotonic()
    deadline = start + a.limit
    while queue or running:
        now = time.monotonic()
        while queue and len(running) < a.workers and now < deadline:
            f = queue.popleft()
            log = open(logs / (Path(f).stem + ".txt"), "w")
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
                 "addopts=--import-mode=append", "-rfE", "--tb=short", f], cwd=ROOT, env=env,
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            running[f] = (proc, now, log)
        if now >= deadline and running:
            for f, (proc, _, _) in running.items():
                if proc.poll() is None and f not in interrupted:
                    os.killpg(proc.pid, signal.SIGINT)
                    interrupted.add(f)
            if now >= deadline + 30:
                for proc, _, _ in running.values():
                    if proc.poll() is None:
                        os.killpg(proc.pid, signal.SIGKILL)
        for f, (proc, t0, log) in list(running.items()):
            if proc.poll() is not None:
                log.close()
                done[f] = (proc.returncode, time.monotonic() - t0, f in interrupted)
                del running[f]
        if now >= deadline and not running:
            break
        time.sleep(0.2)
    remaining = list(queue) + [f for f, (_, _, cut) in done.items() if cut]
    (a.out / "remaining.txt").write_text("".join(f + "\n" for f in remaining))
    lines, failures = [], []
    with open(a.out / "failed.txt", "w") as out:   # the logs of files that did not pass
        for f, (rc, secs, cut) in sorted(done.items(), key=lambda kv: -kv[1][1]):
            log = logs / (Path(f).stem + ".txt")
            text = log.read_text(errors="replace")
            log.unlink()
            found = SUMMARY.findall(text)
            result = found[-1] if found else "(no summary)"
            lines.append(f"{f:48s} rc={rc:<4d} {secs:6.0f}s {'CUT ' if cut else ''}{result}")
            failures += [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
            if rc not in (0, NO_TESTS) or cut:
                out.write(f"\n==== {f} (rc={rc}{', cut' if cut else ''})\n{text[-40000:]}")
    logs.rmdir()
    lines.append(f"{len(done)} files run in {time.monotonic() - start:.0f}s, "
                 f"{len(remaining)} not finished (remaining.txt)")
    lines += failures
    summary = "\n".join(lines)
    (a.out / "summary.txt").write_text(summary + "\n")
    print(summary)
    ok = not remaining and all(rc in (0, NO_TESTS) for rc, _, _ in done.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
