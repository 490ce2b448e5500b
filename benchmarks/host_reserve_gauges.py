"""The engine's host reserve (engine/lora/host_reserve.py) as the gateway's metrics show
it: for benchmarks that time loads before, while or after it is made."""
from __future__ import annotations

import time
import urllib.request


def reserve_state(metrics_url: str) -> dict | None:
    """The engine's host reserve as the gateway's gauges show it ({target, ready, taken}),
    None before the gateway has the engine's first event."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("loramux:host_reserve_") and s.labels.get("replica") == "0":
                out[s.name.removeprefix("loramux:host_reserve_")] = int(s.value)
    return out if len(out) == 3 else None


def wait_reserve(metrics_url: str, timeout_s: float) -> dict:
    """Wait until the host reserve is complete (ready == target; at once without one)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = reserve_state(metrics_url)
        if state is not None and state["ready"] >= state["target"]:
            return state
        if time.monotonic() > deadline:
            raise RuntimeError(f"the host reserve was not complete in {timeout_s} s: {state}")
        time.sleep(0.25)


def reserve_text(row: dict) -> str:
    """A row's reserve before and after its loads: `ready/target, ready/target`."""
    def one(state):
        return "?" if state is None else f"{state['ready']}/{state['target']}"
    return f"{one(row['reserve_before'])}, {one(row['reserve_after'])}"
