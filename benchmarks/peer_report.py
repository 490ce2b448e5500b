"""The table and summary of benchmarks/bench_peers.py's rows: per case ours, each peer,
the floor, and ours / best peer; medians of each side's share of the floor at decode and
at prefill sizes."""
from __future__ import annotations

import statistics

PREFILL_FROM = 257       # tokens: above the decode path (kernels/lora/plan.py)


def summarize(row: dict) -> dict:
    """The row with ours_us, best_peer, best_peer_us, ours_over_best (< 1: ours is faster)
    and each side's % of the floor (None where a side has no time)."""
    res = row["results"]
    ours = res.get("ours", {}).get("us")
    peers = {n: r["us"] for n, r in res.items() if n != "ours" and r and "us" in r}
    best = min(peers, key=peers.get) if peers else None
    best_us = peers.get(best)
    pct = (lambda us: None if us is None else 100 * row["floor_us"] / us)
    return dict(row, ours_us=ours, best_peer=best, best_peer_us=best_us,
                ours_over_best=None if ours is None or best_us is None else ours / best_us,
                ours_pct_floor=pct(ours), best_peer_pct_floor=pct(best_us))


def medians(rows: list[dict]) -> dict:
    """Median % of the floor of ours and of the best peer, at decode and prefill sizes,
    over the cases where both have a time."""
    out = {}
    for phase, pick in (("decode", lambda r: r["tokens"] < PREFILL_FROM),
                        ("prefill", lambda r: r["tokens"] >= PREFILL_FROM)):
        both = [r for r in rows if pick(r) and r["ours_over_best"] is not None]
        out[phase] = None if not both else dict(
            cases=len(both),
            ours_pct_floor=statistics.median(r["ours_pct_floor"] for r in both),
            best_peer_pct_floor=statistics.median(r["best_peer_pct_floor"] for r in both),
            ours_over_best=statistics.median(r["ours_over_best"] for r in both))
    return out


def cell(result: dict | None, name: str) -> str:
    if result is None:
        return "skipped"
    if "us" not in result:
        return result["status"].split(" (")[0].split(":")[0]
    chunk = f" (c{result['chunk']})" if "chunk" in result else ""
    return f"{result['us']:.1f}{chunk}"


def table(rows: list[dict], peers: list[str], status: dict) -> list[str]:
    """Markdown lines: one row per case, then a line per peer without times."""
    head = ["group", "r", "T", "L", "ours path", "floor us", "ours us",
            *[f"{p} us" for p in peers], "ours %floor", "best peer %floor",
            "ours / best peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        f = (lambda v, fmt: "-" if v is None else fmt.format(v))
        cells = [r["group"], r["rank"], r["tokens"], r["adapters"], r["path"],
                 f"{r['floor_us']:.1f}", cell(r["results"].get("ours"), "ours"),
                 *[cell(r["results"].get(p), p) for p in peers],
                 f(r["ours_pct_floor"], "{:.0f}%"), f(r["best_peer_pct_floor"], "{:.0f}%"),
                 f(r["ours_over_best"], "{:.2f}x")]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    for p in peers:
        if not status[p].startswith("ok"):
            lines.append(f"{p}: {status[p]}")
    return lines


def summary_lines(med: dict) -> list[str]:
    out = []
    for phase, m in med.items():
        if m:
            out.append(f"{phase}: median over {m['cases']} cases: ours "
                       f"{m['ours_pct_floor']:.1f}% of the floor, best peer "
                       f"{m['best_peer_pct_floor']:.1f}%, ours / best peer "
                       f"{m['ours_over_best']:.2f}x")
    return out
