"""The serving benchmark's outputs: a markdown table, and PNG plots (latency against
throughput for a rate sweep; throughput and TTFT p99 against the adapter count) when
matplotlib is installed."""
from __future__ import annotations

from pathlib import Path

_HEAD = ("| adapters | load | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms "
         "| e2e p50 / p99 s | SLO | disk reads | slot loads | mean batch | offline tok/s "
         "| offline batch | service/offline | CPU client / gateway / engine | errors |\n"
         + "|---" * 16 + "|")


def _f(x, scale=1.0, digits=1) -> str:
    return "-" if x is None else f"{x * scale:,.{digits}f}"


def _pair(dist: dict, scale: float, digits: int) -> str:
    return f"{_f(dist['p50'], scale, digits)} / {_f(dist['p99'], scale, digits)}"


def _cpu(busy: dict | None) -> str:
    """Cores kept busy (CPU s / wall s) by the client, the gateway and the engine."""
    if not busy:
        return "-"
    return " / ".join(_f(busy.get(k), digits=2) for k in ("client", "gateway", "engine"))


def table(points: list[dict], meta: dict) -> str:
    """The runs, one row each, under a line on the set-up (adapter loads, warm-up)."""
    warm = meta.get("warmup_s") or {}
    load_s, n = meta.get("adapter_load_s"), meta.get("adapters_loaded")
    lines = [f"{n} adapters loaded through AdminClient in {_f(load_s, digits=1)} s "
             f"({_f(load_s / n if load_s and n else None, 1e3, 0)} ms each); "
             f"order: {meta.get('order')}; warm-up s: "
             + ", ".join(f"{k} {v:.1f}" for k, v in warm.items()), "", _HEAD]
    for p in points:
        s, off = p["service"], p.get("offline")
        eng = s.get("engine") or {}
        off_eng = (off or {}).get("engine") or {}
        load = f"{p['rate']:g} req/s" if p["rate"] is not None else f"{p['concurrency']} streams"
        lines.append(
            f"| {p['adapters']} | {load} | {_f(s['req_per_s'], digits=2)} "
            f"| {_f(s['output_tok_per_s'])} | {_pair(s['ttft_s'], 1e3, 0)} "
            f"| {_pair(s['itl_s'], 1e3, 1)} | {_pair(s['e2e_s'], 1, 2)} "
            f"| {_f(s['slo']['attainment'], digits=3)} | {eng.get('adapter_disk_reads', '-')} "
            f"| {eng.get('adapter_slot_loads', '-')} | {_f(eng.get('mean_batch'))} "
            f"| {_f(off['output_tok_per_s']) if off else '-'} | {_f(off_eng.get('mean_batch'))} "
            f"| {_f(p.get('service_over_offline'), digits=3)} | {_cpu(s.get('cpu_busy'))} "
            f"| {sum(s['errors'].values()) if s['errors'] else 0} |")
    return "\n".join(lines)


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        return None


def plot_rate_sweep(points: list[dict], path: Path) -> bool:
    """TTFT and ITL (p50, p99) against output tokens/s, one point per offered rate, one
    line per system (and adapter count, when there are several)."""
    plt = _pyplot()
    if plt is None:
        return False
    points = sorted((p for p in points if p["rate"] is not None), key=lambda p: p["rate"])
    counts = sorted({p["adapters"] for p in points})
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, label in ((axes[0], "ttft_s", "TTFT (s)"), (axes[1], "itl_s", "ITL (s)")):
        for n in counts:
            for system in ("service", "offline"):
                pts = [p for p in points if p.get(system) and p["adapters"] == n]
                x = [p[system]["output_tok_per_s"] for p in pts]
                name = system + (f", {n} adapters" if len(counts) > 1 else "")
                for q, style in (("p50", "o-"), ("p99", "s--")):
                    ax.plot(x, [p[system][key][q] for p in pts], style, label=f"{name} {q}")
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(label)
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
    """Output tokens/s and TTFT p99 against the number of adapters, one line per load."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    n = sorted({p["adapters"] for p in points})
    loads = {(p["rate"], p["concurrency"]) for p in points}
    for rate, conc in sorted(loads, key=str):
        name = f"{rate:g} req/s" if rate is not None else f"{conc} streams"
        for system in ("service", "offline"):
            pts = [p for p in points if p.get(system) and (p["rate"], p["concurrency"]) == (rate, conc)]
            if pts:
                x = [p["adapters"] for p in pts]
                a.plot(x, [p[system]["output_tok_per_s"] for p in pts], "o-", label=f"{system}, {name}")
                b.plot(x, [p[system]["ttft_s"]["p99"] for p in pts], "o-", label=f"{system}, {name}")
    for ax, label in ((a, "output tokens/s"), (b, "TTFT p99 (s)")):
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(n, [str(x) for x in n])
        ax.set_xlabel("adapters")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
