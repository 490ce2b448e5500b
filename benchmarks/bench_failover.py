"""Failover under load: `loramux serve --replicas N` as users run it, a closed loop of
greedy streams, and one engine replica killed (SIGKILL) mid-run. Reports output tokens/s
before the kill, while the replica is gone (until `loramux serve` has it serving again)
and after, the streams that failed (target 0), and whether every stream's tokens equal a
run of the same requests without the fault.

    python -m benchmarks.parallel failover --out DIR                # GPUs: Llama-3-8B shape
    python -m benchmarks.parallel failover --out DIR --tiny         # CPU, demo model
    python -m benchmarks.parallel failover --out DIR -- --max-loras 16  # after --: serve flags

Rounds over one fixed list of requests (prompt, adapter, max_tokens; ignore_eos):
round A without a fault gives every request's tokens, a control round repeats it (how many
streams differ with no fault at all: none on the CPU, many in bf16 on a GPU, where greedy
tokens depend on the batch); round B sends the same requests in
a closed loop of --streams streams, kills replica --kill (its pid from its ready file) at
--kill-at seconds and runs --after-s seconds past the moment the replica is serving
again (a new ready file). Writes failover.json and the services' logs to --out; prints
the table last."""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.append(str(REPO))  # last: hides nothing installed

from benchmarks.serving.files import prepare  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for failover.json and the logs")
    p.add_argument("--tiny", action="store_true", help="the demo model on the CPU, small load")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kill", type=int, default=1, help="the replica killed (default: 1)")
    p.add_argument("--adapters", type=int, default=None, help="default: 16; tiny: 2")
    p.add_argument("--streams", type=int, default=None, help="closed-loop streams (default: 128; tiny: 8)")
    p.add_argument("--requests", type=int, default=None,
                   help="distinct requests, sent round robin (default: 512; tiny: 32)")
    p.add_argument("--prompt-len", type=int, default=None, help="default: 256; tiny: 16")
    p.add_argument("--max-tokens", type=int, default=None, help="default: 128; tiny: 24")
    p.add_argument("--kill-at", type=float, default=None, help="seconds into round B (default: 20; tiny: 8)")
    p.add_argument("--after-s", type=float, default=None,
                   help="round B runs this long after the replica serves again (default: 20; tiny: 8)")
    p.add_argument("--restart-timeout-s", type=float, default=600.0)
    p.add_argument("--layers", type=int, default=None, help="layers of the 8B-shaped model")
    p.add_argument("serve_args", nargs=argparse.REMAINDER, help="after --: `loramux serve` flags")
    return p


def defaults(a) -> None:
    t = a.tiny
    a.adapters = a.adapters or (2 if t else 16)
    a.streams = a.streams or (8 if t else 128)
    a.requests = a.requests or (32 if t else 512)
    a.prompt_len = a.prompt_len or (16 if t else 256)
    a.max_tokens = a.max_tokens or (24 if t else 128)
    a.kill_at = a.kill_at if a.kill_at is not None else (8.0 if t else 20.0)
    a.after_s = a.after_s if a.after_s is not None else (8.0 if t else 20.0)
    a.serve_args = [x for x in a.serve_args if x != "--"]


def start_serve(a, files, workdir: Path) -> tuple[subprocess.Popen, dict]:
    from loramux_services.launcher import free_port

    ports = {k: free_port() for k in ("gateway", "control", "http", "metrics")}
    cmd = [sys.executable, "-m", "loramux_services.serve", "--model", str(files.model),
           "--adapter-root", str(files.adapter_root), "--replicas", str(a.replicas),
           "--workdir", str(workdir), "--gateway-port", str(ports["gateway"]),
           "--control-port", str(ports["control"]), "--http-port", str(ports["http"]),
           "--metrics-port", str(ports["metrics"]), *a.serve_args]
    if a.tiny and "--device" not in a.serve_args:
        cmd += ["--device", "cpu"]
    if files.dummy_weights and "--load-format" not in a.serve_args:
        cmd += ["--load-format", "dummy"]
    log = open(workdir.parent / "serve.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, cwd=REPO)
    return proc, {k: f"127.0.0.1:{v}" for k, v in ports.items()}


def replica_ready(workdir: Path, index: int, replicas: int) -> dict | None:
    name = "engine" if replicas == 1 else f"engine-{index}"
    try:
        return json.loads((workdir / f"{name}.ready.json").read_text())
    except (OSError, ValueError):
        return None


def make_requests(a, files) -> list[tuple[list[int], str, int]]:
    rng = random.Random(0)
    names = list(files.names[:a.adapters])
    return [([rng.choice(files.vocab) for _ in range(a.prompt_len)], names[i % len(names)],
             a.max_tokens) for i in range(a.requests)]


async def closed_loop(gateway: str, requests, streams: int, until, on_token,
                      limit: int | None = None) -> dict[int, list[tuple[list[int], str | None]]]:
    """Sends requests round robin from `streams` concurrent streams until until() is true
    or `limit` were sent; {request index: [(token ids, error) of each send]}."""
    from loramux import LoramuxError
    from loramux.aio import AsyncGenerateClient

    clients = [AsyncGenerateClient(gateway, retry=False) for _ in range(4)]
    out: dict[int, list[tuple[list[int], str | None]]] = {}
    counter = iter(range(limit if limit is not None else 10 ** 9))

    async def worker(w: int) -> None:
        while not until():
            k = next(counter, None)
            if k is None:
                return
            prompt, adapter, max_tokens = requests[k % len(requests)]
            tokens, error = [], None
            try:
                async for resp in clients[w % len(clients)].stream(
                        prompt, adapter, temperature=0.0, max_tokens=max_tokens, ignore_eos=True):
                    tokens.extend(resp.token_ids)
                    on_token(len(resp.token_ids))
            except LoramuxError as err:
                error = err.code.name if err.code is not None else "ERROR"
                await asyncio.sleep(0.05)  # a failing service is not hammered
            out.setdefault(k % len(requests), []).append((tokens, error))

    await asyncio.gather(*(worker(w) for w in range(streams)))
    for c in clients:
        await c.close()
    return out


def run(a, out: Path) -> dict:
    from loramux.client import AdminClient

    from loramux_services.launcher import wait_serving

    work = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    files = prepare(work, tiny=a.tiny, num_adapters=a.adapters, distinct=min(4, a.adapters),
                    layers=a.layers)
    workdir = work / "serve"
    proc, addr = start_serve(a, files, workdir)
    row: dict = {"replicas": a.replicas, "streams": a.streams, "requests": a.requests,
                 "prompt_len": a.prompt_len, "max_tokens": a.max_tokens}
    try:
        t = time.perf_counter()
        wait_serving(addr["gateway"], timeout_s=1800)
        row["startup_s"] = time.perf_counter() - t
        with AdminClient(addr["control"]) as admin:
            for name in files.names[:a.adapters]:
                admin.load(name, name)
        requests = make_requests(a, files)
        # round A: every request once, no fault
        ref = asyncio.run(closed_loop(addr["gateway"], requests, a.streams, lambda: False,
                                      lambda n: None, limit=len(requests)))
        reference = {k: v[0][0] for k, v in ref.items() if v and v[0][1] is None}
        row["reference_failed"] = sum(1 for v in ref.values() if v[0][1] is not None)
        # the control: the same requests again, still no fault. Where the numerics depend
        # on the batch a request shares (bf16 GEMMs on a GPU pick tiles by the step's
        # size; a random-weight model's logits are near ties), greedy tokens differ from
        # round A without any fault, and round B's identity is read against this rate
        again = asyncio.run(closed_loop(addr["gateway"], requests, a.streams, lambda: False,
                                        lambda n: None, limit=len(requests)))
        row["control_streams"] = sum(1 for k, v in again.items() if k in reference
                                     and v[0][1] is None)
        row["control_mismatched"] = sum(1 for k, v in again.items() if k in reference
                                        and v[0][1] is None and v[0][0] != reference[k])
        # round B: the fault
        ticks: list[tuple[float, int]] = []
        t0 = time.perf_counter()
        state = {"killed_at": None, "back_at": None, "old": None}

        def until() -> bool:
            now = time.perf_counter() - t0
            if state["killed_at"] is None and now >= a.kill_at:
                ready = replica_ready(workdir, a.kill, a.replicas)
                state["old"] = ready["pid"]
                os.kill(ready["pid"], signal.SIGKILL)
                state["killed_at"] = now
            elif state["killed_at"] is not None and state["back_at"] is None:
                ready = replica_ready(workdir, a.kill, a.replicas)
                if ready and ready.get("pid") != state["old"]:
                    state["back_at"] = now
                elif now - state["killed_at"] > a.restart_timeout_s:
                    state["back_at"] = float("nan")
            if proc.poll() is not None:
                return True
            back = state["back_at"]
            return back is not None and (back != back or now >= back + a.after_s)

        got = asyncio.run(closed_loop(addr["gateway"], requests, a.streams, until,
                                      lambda n: ticks.append((time.perf_counter() - t0, n))))
        results = [r for v in got.values() for r in v]
        row["round_b_streams"] = len(results)
        row["failed_streams"] = sum(1 for _, e in results if e is not None)
        row["errors"] = sorted({e for _, e in results if e is not None})
        row["mismatched_streams"] = sum(
            1 for k, v in got.items() for toks, e in v
            if e is None and k in reference and toks != reference[k])
        row["serve_alive"] = proc.poll() is None
        row["failovers"] = failovers(addr["metrics"])
        row.update(kill_s=state["killed_at"], back_s=state["back_at"],
                   restart_s=(state["back_at"] - state["killed_at"])
                   if state["killed_at"] is not None and state["back_at"] is not None else None)
        end = time.perf_counter() - t0
        row["tok_s"] = phases(ticks, state["killed_at"], state["back_at"], end)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
        keep = out / "logs"
        keep.mkdir(parents=True, exist_ok=True)
        for log in [*workdir.glob("*.log"), work / "serve.log"]:
            (keep / log.name).write_bytes(log.read_bytes())
    return row


def failovers(metrics: str) -> dict[str, int]:
    """The gateway's count of requests sent again to a live replica, by kind (resent: no
    token delivered yet; resumed: after some), from its /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=10).read().decode()
    out = {"resent": 0, "resumed": 0}
    for line in text.splitlines():
        if line.startswith("loramux:requests_resumed_total{"):
            kind = line.split('reason="', 1)[1].split('"', 1)[0]
            out[kind] = int(float(line.rsplit(" ", 1)[1]))
    return out


def phases(ticks, kill_s, back_s, end_s) -> dict:
    """Output tokens/s before the kill (from a few seconds in), while the replica was
    gone, and after it served again."""
    def rate(a, b):
        if a is None or b is None or b != b or b <= a:
            return None
        return sum(n for t, n in ticks if a <= t < b) / (b - a)
    start = min(3.0, (kill_s or end_s) / 2)
    return {"before": rate(start, kill_s), "during": rate(kill_s, back_s),
            "after": rate(back_s, end_s)}


def table(r: dict) -> str:
    f = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    tok, fo = r.get("tok_s", {}), r.get("failovers", {})
    return "\n".join([
        "| replicas | streams | tok/s before | during | after | restart s | streams (B) | failed | "
        "resent / resumed | not identical (B) | not identical, no fault | serve alive |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        f"| {r['replicas']} | {r['streams']} | {f(tok.get('before'))} | {f(tok.get('during'))} | "
        f"{f(tok.get('after'))} | {f(r.get('restart_s'))} | {r.get('round_b_streams')} | "
        f"{r.get('failed_streams')} {r.get('errors') or ''} | "
        f"{fo.get('resent')} / {fo.get('resumed')} | {r.get('mismatched_streams')} | "
        f"{r.get('control_mismatched')} of {r.get('control_streams')} | "
        f"{r.get('serve_alive')} |"])


def passed(r: dict) -> bool:
    """No failed stream, the service up; and where a fault-free repeat gives round A's
    tokens exactly (the CPU in float32), round B gives them too. Where it does not (bf16
    on a GPU), identity says nothing about the fault and the table shows both counts."""
    if r.get("failed_streams") != 0 or not r.get("serve_alive"):
        return False
    return r.get("control_mismatched") != 0 or r.get("mismatched_streams") == 0


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    defaults(a)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    row = run(a, out)
    (out / "failover.json").write_text(json.dumps(row, indent=1))
    print(table(row), flush=True)
    return 0 if passed(row) else 1


if __name__ == "__main__":
    sys.exit(main())
