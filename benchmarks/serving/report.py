"""The serving benchmark's outputs: a markdown table (one row per point, printed as each
point finishes and again at the end), and PNG plots (latency against throughput for a
rate sweep; throughput and TTFT p99 against the adapter count) when matplotlib is
installed."""
from __future__ import annotations

from pathlib import Path

_COLUMNS = ("adapters", "popularity", "load", "req/s", "out tok/s", "TTFT p50 / p99 ms",
            "ITL p50 / p99 ms", "e2e p50 / p99 s", "SLO", "swaps/s", "host->slot MB/s",
            "disk reads (MB/s)", "mean batch", "CPU engine / gateway / client",
            "errors / cut", "loads in window", "offline tok/s", "service/offline",
            "tok/s, TTFT p99 vs fewest adapters")
_NOT_BASELINE = ("first", "during loads")  # rounds that are no point's baseline


def _f(x, scale=1.0, digits=1) -> str:
    return "-" if x is None else f"{x * scale:,.{digits}f}"


def _pair(dist: dict, scale: float, digits: int) -> str:
    return f"{_f(dist['p50'], scale, digits)} / {_f(dist['p99'], scale, digits)}"


def _cpu(busy: dict | None) -> str:
    """Cores kept busy (CPU s / wall s) by the engine, the gateway and the client."""
    if not busy:
        return "-"
    return " / ".join(_f(busy.get(k), digits=2) for k in ("engine", "gateway", "client"))


def label(p: dict) -> str:
    load = f"{p['rate']:g} req/s" if p["rate"] is not None else f"{p['concurrency']} streams"
    extra = f" ({p['round']} round)" if p.get("round") else ""
    return f"{p['adapters']} adapters, {p['popularity']}, {load}{extra}"


def header() -> str:
    return "| " + " | ".join(_COLUMNS) + " |\n" + "|---" * len(_COLUMNS) + "|"


def _baseline(p: dict, points: list[dict]) -> dict | None:
    """The measured point with the fewest adapters at p's load and popularity (a single
    adapter's point stands for every popularity); None if that is p itself."""
    same = [q for q in points if q.get("service") and q.get("round") not in _NOT_BASELINE
            and (q["rate"], q["concurrency"]) == (p["rate"], p["concurrency"])]
    base = min((q for q in same if q["popularity"] == p["popularity"]),
               key=lambda q: q["adapters"], default=None)
    if base is None or base["adapters"] == p["adapters"]:  # one adapter stands for any
        base = min((q for q in same if q["adapters"] == 1), key=lambda q: q["adapters"],
                   default=base)
    return None if base is None or base["adapters"] == p["adapters"] else base


def vs_fewest(p: dict, points: list[dict]) -> tuple[float | None, float | None]:
    """(output tok/s, TTFT p99) of p's service run over its baseline's (_baseline)."""
    base = _baseline(p, points)
    if base is None or not p.get("service"):
        return None, None
    a, b = p["service"], base["service"]
    tok = a["output_tok_per_s"] / b["output_tok_per_s"] if b["output_tok_per_s"] else None
    ttft = a["ttft_s"]["p99"] / b["ttft_s"]["p99"] \
        if a["ttft_s"]["p99"] is not None and b["ttft_s"]["p99"] else None
    return tok, ttft


def row(p: dict, points: list[dict] = ()) -> str:
    """p's row; `points`, all of the run's so far, give the comparison to the fewest
    adapters."""
    s, off = p.get("service"), p.get("offline")
    if s is None:
        return f"| {label(p)} | skipped |"
    eng, mv = s.get("engine") or {}, s.get("movement") or {}
    load = f"{p['rate']:g} req/s" if p["rate"] is not None else f"{p['concurrency']} streams"
    if p.get("round"):
        load += f", {p['round']}"
    errors = sum(s["errors"].values()) if s["errors"] else 0
    cells = (
        p["adapters"], p["popularity"], load, _f(s["req_per_s"], digits=2),
        _f(s["output_tok_per_s"]), _pair(s["ttft_s"], 1e3, 0), _pair(s["itl_s"], 1e3, 1),
        _pair(s["e2e_s"], 1, 2), _f(s["slo"]["attainment"], digits=3),
        _f(mv.get("swaps_per_s")), _f(mv.get("slot_bytes_per_s"), 1e-6, 0),
        f"{eng.get('adapter_disk_reads', '-')} ({_f(mv.get('disk_bytes_per_s'), 1e-6, 0)})",
        _f(eng.get("mean_batch")), _cpu(s.get("cpu_busy")), f"{errors} / {s.get('cut', 0)}",
        p.get("loads_in_window", "-"),
        _f(off["output_tok_per_s"]) if off else "-",
        _f(p.get("service_over_offline"), digits=3),
        " / ".join(_f(x, digits=3) for x in vs_fewest(p, list(points))))
    return "| " + " | ".join(str(c) for c in cells) + " |"


def first_over_steady(first: dict | None, steady: dict | None,
                      key: str | None = None) -> float | None:
    """Output tok/s of the first timed round after start over the same round run again:
    over all of each run (from its start, when windowed), or `key`'s summary."""
    try:
        k = key or ("service_from_start" if "service_from_start" in first else "service")
        return first[k]["output_tok_per_s"] / steady[k]["output_tok_per_s"]
    except (TypeError, KeyError, ZeroDivisionError):
        return None


def _find(points: list[dict], n: int, pop: str | None) -> dict | None:
    """The measured point of n adapters (popularity pop; any for None), no repeat round."""
    return next((p for p in points if p.get("service") and p["adapters"] == n
                 and p.get("round") not in _NOT_BASELINE
                 and (pop is None or p["popularity"] == pop)), None)


def targets(points: list[dict]) -> list[dict]:
    """Issue 20's targets that the points measure: 256 adapters >= 0.90x the throughput of
    32 (each popularity); 1,000 and 2,000 under Zipf >= 0.97x the throughput of 5 under
    the same Zipf with TTFT p99 <= 2x (the same load for both sides of each)."""
    out = []
    pops = sorted({p["popularity"] for p in points if p.get("service")})
    for pop in pops:
        pairs = [(256, 32, 0.90, None)]
        if pop.startswith("zipf"):
            pairs += [(1000, 5, 0.97, 2.0), (2000, 5, 0.97, 2.0)]
        for n, base_n, tok_min, ttft_max in pairs:
            a, b = _find(points, n, pop), _find(points, base_n, pop)
            if not a or not b or (a["rate"], a["concurrency"]) != (b["rate"], b["concurrency"]):
                continue
            tok = _ratio(a["service"]["output_tok_per_s"], b["service"]["output_tok_per_s"])
            ttft = _ratio(a["service"]["ttft_s"]["p99"], b["service"]["ttft_s"]["p99"])
            met = tok is not None and tok >= tok_min and (
                ttft_max is None or (ttft is not None and ttft <= ttft_max))
            out.append({"adapters": n, "baseline": base_n, "popularity": pop,
                        "tok_ratio": tok, "tok_min": tok_min, "ttft_p99_ratio": ttft,
                        "ttft_max": ttft_max, "met": met})
    return out


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def _target_line(t: dict) -> str:
    ttft = "" if t["ttft_max"] is None else \
        f", TTFT p99 {_f(t['ttft_p99_ratio'], digits=2)}x (target <= {t['ttft_max']:g}x)"
    return (f"target {t['adapters']} vs {t['baseline']} adapters, {t['popularity']}: tok/s "
            f"{_f(t['tok_ratio'], digits=3)}x (target >= {t['tok_min']:.2f}){ttft}: "
            + ("met" if t["met"] else "NOT met"))


_LOADS = {"service_one": "service, one adapter alone (the first load after start)",
          "service_second": "service, one adapter alone (the second load)",
          "service_first": "service, the first point's other adapters",
          "service": "service", "offline": "offline"}


def _load_line(name: str, rep: dict | None) -> str:
    if not rep:
        return f"{name}: no adapters loaded"
    lat = rep["latency_ms"]
    rate = f", {rep['loads_per_s']:.1f} loads/s" if rep.get("loads_per_s") else ""
    return (f"{name}: {rep['adapters']} adapters loaded in {_f(rep['wall_s'])} s, "
            f"{rep['workers']} allowed in flight ({rep.get('max_in_flight', '-')} at most): "
            f"{_f(rep['per_adapter_ms'])} ms per adapter{rate} "
            f"(each load p50 {_f(lat['p50'], digits=0)} / p99 {_f(lat['p99'], digits=0)} ms)")


def table(points: list[dict], meta: dict) -> str:
    """The points, one row each, under lines on the set-up (start-up, adapter loads,
    warm-up, first round against steady state)."""
    loads = meta.get("loads") or {}
    lines = [_load_line(v, loads.get(k)) for k, v in _LOADS.items() if k in loads]
    starts = meta.get("startup_s") or {}
    warm = meta.get("warmup_s") or {}
    lines.append("start-up s: " + (", ".join(f"{k} {v:.1f}" for k, v in starts.items()) or "-")
                 + "; warm-up round s: " + (", ".join(f"{k} {v:.1f}" for k, v in warm.items())
                                            or "none"))
    if meta.get("engine_warmup"):
        lines.append(f"service engine start-up {meta['engine_warmup']}")
    ratio = meta.get("first_round_over_steady")
    if ratio is not None:
        window = meta.get("first_round_over_steady_window")
        lines.append(f"first round after start / steady state: {ratio:.3f} "
                     f"({'within' if abs(ratio - 1) <= 0.05 else 'NOT within'} 5%)"
                     + (f"; over the measured windows only: {window:.3f}"
                        if window is not None and meta.get("windowed") else ""))
    if meta.get("during_loads_over_steady") is not None:
        lines.append(f"the first point while the other adapters load / without loads: "
                     f"{meta['during_loads_over_steady']:.3f}")
    lines += [_target_line(t) for t in meta.get("targets") or []]
    lines.append(f"order: {meta.get('order')}")
    lines += ["", header(), *(row(p, points) for p in _table_order(points))]
    if meta.get("windowed"):
        lines += ["", "In short (the service, each point's window):", "", *short_table(points)]
    return "\n".join(lines)


_SHORT = ("adapters", "popularity", "round", "start s", "out tok/s", "TTFT p50 / p99 ms",
          "ITL p50 / p99 ms", "step ms", "swaps/s", "swap ms", "MB/s host->slot / disk",
          "engine cores", "loads in window", "errors", "tok/s, TTFT p99 vs fewest")


def _mean_ms(eng: dict, total: str, count: str) -> float | None:
    return 1e3 * eng[total] / eng[count] if eng.get(count) else None


def short_table(points: list[dict]) -> list[str]:
    """The columns issue 20 asks for, one row per point in run order (skipped ones too)."""
    out = ["| " + " | ".join(_SHORT) + " |", "|---" * len(_SHORT) + "|"]
    for p in points:
        s = p.get("service")
        head = [str(p["adapters"]), p["popularity"], p.get("round") or ""]
        if s is None:
            why = (p.get("skipped") or {}).get("service", "not run")
            out.append("| " + " | ".join(head + [f"skipped: {why}"]) + " |")
            continue
        mv, busy, eng = s.get("movement") or {}, s.get("cpu_busy") or {}, s.get("engine") or {}
        cells = head + [
            _f(p.get("started_s"), digits=0), _f(s["output_tok_per_s"]),
            _pair(s["ttft_s"], 1e3, 0), _pair(s["itl_s"], 1e3, 1), _f(eng.get("mean_step_ms")),
            _f(mv.get("swaps_per_s")), _f(_mean_ms(eng, "slot_load_s", "slot_load_count")),
            f"{_f(mv.get('slot_bytes_per_s'), 1e-6, 0)} / {_f(mv.get('disk_bytes_per_s'), 1e-6, 0)}",
            _f(busy.get("engine"), digits=2), str(p.get("loads_in_window", "-")),
            ", ".join(f"{k} {v}" for k, v in sorted(s["errors"].items())) or "0",
            " / ".join(_f(x, digits=3) for x in vs_fewest(p, points))]
        out.append("| " + " | ".join(cells) + " |")
    return out


def _table_order(points: list[dict]) -> list[dict]:
    """By load, adapter count and popularity (repeats of a point after it, in run order)."""
    order = {id(p): k for k, p in enumerate(points)}
    return sorted(points, key=lambda p: (str(p["rate"]), str(p["concurrency"]), p["adapters"],
                                         p["popularity"], order[id(p)]))


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def _measured(points: list[dict]) -> list[dict]:
    """The points to plot: measured, and the repeated first point only once (steady)."""
    return [p for p in points if p.get("service") and p.get("round") not in _NOT_BASELINE]


def plots(points: list[dict], out: Path) -> list[str]:
    """Every plot the points make sense for; the file names written."""
    pts = _measured(points)
    made = []
    if len({p["rate"] for p in pts if p["rate"] is not None}) > 1 and \
            plot_rate_sweep(pts, out / "latency_vs_throughput.png"):
        made.append("latency_vs_throughput.png")
    if len({p["adapters"] for p in pts}) > 1 and plot_adapter_sweep(pts, out / "adapters.png"):
        made.append("adapters.png")
    return made


def plot_rate_sweep(points: list[dict], path: Path) -> bool:
    """TTFT and ITL (p50, p99) against output tokens/s, one point per offered rate, one
    line per system (and adapter count and popularity, when there are several)."""
    plt = _pyplot()
    if plt is None:
        return False
    points = sorted((p for p in points if p["rate"] is not None), key=lambda p: p["rate"])
    groups = sorted({(p["adapters"], p["popularity"]) for p in points})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, name in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "itl_s", "ITL (s)")):
        for n, pop in groups:
            for system in ("service", "offline"):
                pts = [p for p in points if p.get(system) and (p["adapters"], p["popularity"]) == (n, pop)]
                if not pts:
                    continue
                x = [p[system]["output_tok_per_s"] for p in pts]
                tag = system + (f", {n} adapters {pop}" if len(groups) > 1 else "")
                for q, style in (("p50", "o-"), ("p99", "s--")):
                    ax.plot(x, [p[system][key][q] for p in pts], style, label=f"{tag} {q}")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    rates = sorted({p["rate"] for p in points})
    fig.suptitle("latency vs throughput, offered rates " + ", ".join(f"{r:g}" for r in rates)
                 + " req/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_adapter_sweep(points: list[dict], path: Path) -> bool:
    """Output tokens/s and TTFT p99 against the number of adapters, one line per
    (popularity, load, system); a single adapter's point belongs to every popularity."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    n = sorted({p["adapters"] for p in points})
    pops = sorted({p["popularity"] for p in points if p["adapters"] > 1}) or ["uniform"]
    loads = sorted({(p["rate"], p["concurrency"]) for p in points}, key=str)
    for pop in pops:
        for rate, conc in loads:
            tag = f"{pop}, " + (f"{rate:g} req/s" if rate is not None else f"{conc} streams")
            for system in ("service", "offline"):
                pts = sorted((p for p in points if p.get(system)
                              and (p["rate"], p["concurrency"]) == (rate, conc)
                              and (p["popularity"] == pop or p["adapters"] == 1)),
                             key=lambda p: p["adapters"])
                if pts:
                    x = [p["adapters"] for p in pts]
                    a.plot(x, [p[system]["output_tok_per_s"] for p in pts], "o-",
                           label=f"{system}, {tag}")
                    b.plot(x, [p[system]["ttft_s"]["p99"] for p in pts], "o-",
                           label=f"{system}, {tag}")
    for ax, name in ((a, "output tokens/s"), (b, "TTFT p99 (s)")):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("adapters")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
