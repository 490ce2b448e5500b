"""The serving benchmark's outputs: a markdown table (one row per point, printed as each
point finishes and again at the end), and PNG plots (latency against throughput for a
rate sweep; throughput and TTFT p99 against the adapter count) when matplotlib is
installed."""
from __future__ import annotations

from pathlib import Path

_COLUMNS = ("adapters", "popularity", "load", "req/s", "out tok/s", "TTFT p50 / p99 ms",
            "ITL p50 / p99 ms", "e2e p50 / p99 s", "SLO", "swaps/s", "host->slot MB/s",
            "disk reads", "mean batch", "CPU engine / gateway / client", "errors / cut",
            "offline tok/s", "service/offline", "tok/s, TTFT p99 vs fewest adapters")


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
    same = [q for q in points if q.get("service") and q.get("round") != "first"
            and (q["rate"], q["concurrency"]) == (p["rate"], p["concurrency"])
            and (q["popularity"] == p["popularity"] or q["adapters"] == 1)]
    base = min(same, key=lambda q: q["adapters"], default=None)
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
        eng.get("adapter_disk_reads", "-"), _f(eng.get("mean_batch")),
        _cpu(s.get("cpu_busy")), f"{errors} / {s.get('cut', 0)}",
        _f(off["output_tok_per_s"]) if off else "-",
        _f(p.get("service_over_offline"), digits=3),
        " / ".join(_f(x, digits=3) for x in vs_fewest(p, list(points))))
    return "| " + " | ".join(str(c) for c in cells) + " |"


def first_over_steady(first: dict | None, steady: dict | None) -> float | None:
    """Output tok/s of the first timed round after start over the same round run again."""
    try:
        return first["service"]["output_tok_per_s"] / steady["service"]["output_tok_per_s"]
    except (TypeError, KeyError, ZeroDivisionError):
        return None


def _load_line(name: str, rep: dict | None) -> str:
    if not rep:
        return f"{name}: no adapters loaded"
    lat = rep["latency_ms"]
    return (f"{name}: {rep['adapters']} adapters loaded in {_f(rep['wall_s'])} s, "
            f"{rep['workers']} in flight: {_f(rep['per_adapter_ms'])} ms per adapter "
            f"(each load p50 {_f(lat['p50'], digits=0)} / p99 {_f(lat['p99'], digits=0)} ms)")


def table(points: list[dict], meta: dict) -> str:
    """The points, one row each, under lines on the set-up (start-up, adapter loads,
    warm-up, first round against steady state)."""
    loads = meta.get("loads") or {}
    lines = [_load_line(k, loads.get(k)) for k in ("service", "offline") if k in loads]
    starts = meta.get("startup_s") or {}
    warm = meta.get("warmup_s") or {}
    lines.append("start-up s: " + (", ".join(f"{k} {v:.1f}" for k, v in starts.items()) or "-")
                 + "; warm-up round s: " + (", ".join(f"{k} {v:.1f}" for k, v in warm.items())
                                            or "none"))
    if meta.get("engine_warmup"):
        lines.append(f"service engine start-up {meta['engine_warmup']}")
    ratio = meta.get("first_round_over_steady")
    if ratio is not None:
        lines.append(f"first round after start / steady state: {ratio:.3f} "
                     f"({'within' if ratio >= 0.95 else 'NOT within'} 5%)")
    lines.append(f"order: {meta.get('order')}")
    lines += ["", header(), *(row(p, points) for p in points)]
    return "\n".join(lines)


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
    return [p for p in points if p.get("service") and p.get("round") != "first"]


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
