"""The gateway's Prometheus endpoint under load, with real engine, control plane and gateway
processes: queue, KV and adapter state move as the engine saturates and drains, the
router's info gauge lists running and waiting adapters, histograms count steps, swaps and
disk reads, and per-adapter series stay bounded."""
from __future__ import annotations

import asyncio
import time
import urllib.request

import pytest
from loramux import AdminClient, GenerateClient, LoramuxError
from loramux.aio import AsyncGenerateClient
from prometheus_client.parser import text_string_to_metric_families

from loramux_services.launcher import Cluster, ClusterConfig, wait_serving
from tests.support.tiny import AdapterSpec, TinySpec, make_adapter, make_model

pytestmark = pytest.mark.timeout(300)
ADAPTERS = ("a1", "a2", "a3")
PROMPT = "once upon a time there was a tiny model that could. " * 4  # a few full KV blocks
# eight streams over two sequences per step: saturated for thousands of steps (200 tokens
# a stream, about a second on an idle CPU, once ended before a scrape caught it)
NEW_TOKENS = 1000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("metrics")
    model = make_model(root / "model", TinySpec(max_position_embeddings=4096))
    for i, name in enumerate(ADAPTERS, start=1):
        make_adapter(root / "adapters" / name, model, AdapterSpec(seed=50 + i))
    # two sequences per batch and two GPU slots / host copies for three adapters: the
    # engine saturates, swaps adapters between slots and reads evicted ones back from disk
    cfg = ClusterConfig(model=str(model), adapter_roots=(str(root / "adapters"),),
                        workdir=str(root / "run"), metrics_port=0,
                        # on the CPU: a GPU finishes the load below before a scrape can
                        # catch it saturated (the metrics are the same on either device)
                        # (and a host reserve for both host copies, off by default on
                        # the CPU: its gauges)
                        engine_args=("--device", "cpu", "--max-num-seqs", "2",
                                     "--max-loras", "2", "--max-cpu-loras", "2",
                                     "--host-reserve-loras", "2"),
                        gateway_args=("--metrics-max-adapters", "2"),
                        control_args=("--metrics-port", "0"),
                        env={"OMP_NUM_THREADS": "1"})
    c = Cluster(cfg)
    c.start()
    try:
        ready = c.wait_ready()
        wait_serving(c.gateway_address)
        c.metrics_url = f"http://127.0.0.1:{ready['gateway']['metrics_port']}/metrics"
        c.control_metrics_url = f"http://127.0.0.1:{ready['control']['metrics_port']}/metrics"
        yield c
    finally:
        c.close()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value}"""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples, name, **labels) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def info_labels(samples) -> dict:
    labels = next(dict(labels) for (name, labels) in samples if name == "loramux:lora_requests_info")
    assert labels.pop("replica") == "0"  # the one engine replica
    return labels


def wait_for(url, predicate, timeout_s=30.0, what=""):
    deadline = time.monotonic() + timeout_s
    while True:
        samples = scrape(url)
        if predicate(samples):
            return samples
        assert time.monotonic() < deadline, f"metrics never showed {what}"
        time.sleep(0.05)


def test_metrics_follow_load(cluster):
    url = cluster.metrics_url
    with AdminClient(cluster.control_address) as admin:
        for name in ADAPTERS:
            admin.load(name, name)
    idle = wait_for(url, lambda s: value(s, "loramux:registry_adapters", state="loaded") == 3
                    and ("loramux:num_requests_waiting", (("replica", "0"),)) in s
                    # the two loads that found room in the host tier (max_cpu_loras 2) read
                    # their files; the third is lazy: read when a request first needs it
                    and value(s, "loramux:adapter_disk_read_seconds_count", replica="0") >= 2
                    # both reads took a buffer the host reserve had made ready
                    and value(s, "loramux:host_reserve_taken", replica="0") == 2,
                    what="the three adapters loaded")
    assert value(idle, "loramux:host_reserve_target", replica="0") == 2
    assert value(idle, "loramux:host_reserve_ready", replica="0") == 2
    assert value(idle, "loramux:engine_up", replica="0") == 1
    assert value(idle, "loramux:num_requests_running", replica="0") == 0
    assert value(idle, "loramux:kv_cache_blocks_total", replica="0") > 0
    assert value(idle, "loramux:max_loras", replica="0") == 2
    assert info_labels(idle) == {"running_lora_adapters": "", "waiting_lora_adapters": "",
                                 "max_lora": "2"}
    with GenerateClient(cluster.gateway_address) as gen:  # a1, a2 take the two adapter labels
        for name in ("a1", "a2"):
            gen.generate("the quick brown fox", name, max_tokens=2, temperature=0.0)

    # The gauges are sampled, so the test waits for one scrape that shows the saturated engine
    # (two running, more waiting, KV in use, adapters in both labels) while a load long enough
    # to stay saturated for hundreds of steps runs, instead of hoping to catch a moment.
    def saturated(s) -> bool:
        if ("loramux:num_requests_waiting", (("replica", "0"),)) not in s:
            return False
        info = info_labels(s)
        running = set(filter(None, info["running_lora_adapters"].split(",")))
        waiting = set(filter(None, info["waiting_lora_adapters"].split(",")))
        return (value(s, "loramux:num_requests_waiting", replica="0") > 0
                and value(s, "loramux:num_requests_running", replica="0") == 2  # max_num_seqs
                and value(s, "loramux:kv_cache_blocks_used", replica="0") > 0
                and 0 < value(s, "loramux:kv_cache_usage_perc", replica="0") <= 1
                and bool(running) and running <= set(ADAPTERS)
                and bool(waiting) and waiting <= set(ADAPTERS))

    async def load():
        async with AsyncGenerateClient(cluster.gateway_address) as client:
            names = [*ADAPTERS, None] * 2
            return await asyncio.gather(*(
                client.generate(PROMPT, name, max_tokens=NEW_TOKENS, temperature=0.0,
                                ignore_eos=True) for name in names))

    async def main():
        task = asyncio.ensure_future(load())
        try:
            await asyncio.to_thread(wait_for, url, saturated, 120.0, "the saturated engine")
        finally:
            outs = await task
        return outs

    outs = asyncio.run(main())
    assert all(len(o.token_ids) == NEW_TOKENS for o in outs)

    after = wait_for(url, lambda s: value(s, "loramux:num_requests_running", replica="0") == 0
                     and value(s, "loramux:kv_cache_blocks_used", replica="0") == 0, what="the drained engine")
    assert value(after, "loramux:num_requests_waiting", replica="0") == 0
    assert info_labels(after)["running_lora_adapters"] == ""
    assert value(after, "loramux:step_seconds_count", replica="0") > NEW_TOKENS
    assert value(after, "loramux:batch_size_count", replica="0") > NEW_TOKENS
    assert value(after, "loramux:engine_gc_pause_seconds_count", replica="0") >= 0  # exported
    steps = value(after, "loramux:batch_size_count", replica="0")
    assert value(after, "loramux:batch_size_sum", replica="0") > steps  # steps of two sequences
    assert value(after, "loramux:batch_size_bucket", replica="0", le="2.0") == steps  # none more
    # three adapters through two slots: each was loaded into one (a3 by evicting a1 or a2)
    assert value(after, "loramux:adapter_slot_load_seconds_count", replica="0") >= 3
    assert value(after, "loramux:adapter_slot_load_seconds_sum", replica="0") > 0
    assert sum(value(after, "loramux:adapters", replica="0", tier=t) for t in ("slot", "host", "disk")) == 3
    assert value(after, "loramux:adapter_slots_used", replica="0") <= 2
    prompt_tokens = sum(o.usage.prompt_tokens for o in outs)
    assert value(after, "loramux:prefix_cache_queries_total") >= prompt_tokens
    assert value(after, "loramux:prefix_cache_hits_total") > 0  # the same prompt, repeated
    # bounded per-adapter series: a3 came third with a cap of two adapter labels
    assert value(after, "loramux_requests_total", adapter="a1", status="OK") == 3
    assert value(after, "loramux_requests_total", adapter="other", status="OK") == 2
    assert value(after, "loramux_requests_total", adapter="", status="OK") == 2
    assert not any(dict(labels).get("adapter") == "a3" for _, labels in after)


def test_control_plane_metrics(cluster):
    """Admin calls by method and status, with latency, on the control plane's endpoint."""
    with AdminClient(cluster.control_address) as admin:
        admin.load("a2", "a2")  # the test above loaded it; alone, it is loaded here
    before = scrape(cluster.control_metrics_url)
    with AdminClient(cluster.control_address) as admin:
        admin.load("a1", "a1")  # already loaded by the test above, or loaded now
        admin.get("a2")
        with pytest.raises(LoramuxError):
            admin.get("nope")
    after = scrape(cluster.control_metrics_url)

    def delta(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert delta("loramux_admin_calls_total", method="LoadAdapter", code="OK") == 1
    assert delta("loramux_admin_calls_total", method="GetAdapter", code="OK") == 1
    assert delta("loramux_admin_calls_total", method="GetAdapter", code="NOT_FOUND") == 1
    assert delta("loramux_admin_call_seconds_count", method="GetAdapter") == 2
    assert value(after, "loramux_engine_replays_total") >= 1  # the engine's first connect
