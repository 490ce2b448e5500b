"""A model-based stress of the real engine's adapter lifecycle, driven by a seeded generator.

Random loads, reloads with other weights, unloads, pins, unpins, requests, aborts and steps
over more adapter names than device slots and host copies. A small model of the rules is
kept alongside and checked after every operation:

- limits: slots and host copies within bounds; a pinned version is never evicted;
- references: each version's in-flight count is what the model says;
- progress: no request waits for admission longer than the bound stated in
  engine/scheduler.py ("Progress across the three tiers"), computed from the engine's
  configuration at the request's arrival;
- tokens: every finished request's tokens equal the same request run alone with the
  weights of the version it ran with (greedy, so a shorter max_tokens is a prefix);
- idle: after the run every request drained, every KV block free, no reference left;
  once every name is unloaded, no slot, host copy or KV namespace of an adapter is left.

Disk reads are awaited after every step, so a run is a pure function of its seed (the
bound excludes read time, see the scheduler). The preconditions of the bound (no wait for
`max_num_seqs` or KV blocks, no preemption) hold by construction: live requests never
exceed `max_num_seqs` and the KV pool holds twice that many of the longest request;
the run asserts that no request was preempted.
"""
from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from loramux_engine import Engine, EngineConfig, FinishReason, SamplingParams
from loramux_engine.request import RequestStatus
from loramux_engine.scheduler import SchedulerConfig
from loramux_core.errors import AdapterNotFoundError, AdapterUnavailableError, CapacityError

PROMPT_LENS = (3, 5, 9, 12)
OPS = ("load", "reload", "unload", "pin", "unpin", "request", "burst", "abort", "step")
# phases of PHASE_OPS operations alternate at random between admin work mixed with
# traffic, and traffic alone with a stream of one hot adapter's requests (one before
# every step): where a cold adapter's disk read used to never start
MIXED = (4, 3, 2, 2, 2, 16, 4, 1, 30)
TRAFFIC = (0, 0, 0, 0, 0, 24, 6, 1, 30)
PHASE_OPS = 60


@dataclass(frozen=True)
class StressConfig:
    max_loras: int = 2
    max_cpu_loras: int = 2
    async_scheduling: bool = False
    names: tuple[str, ...] = ("a", "b", "c", "d", "e", "f")
    max_tokens: int = 4
    max_num_seqs: int = 12
    max_num_batched_tokens: int = 32
    block_size: int = 4

    def engine_config(self, model_dir: str | Path) -> EngineConfig:
        longest = max(PROMPT_LENS) + self.max_tokens
        blocks = 2 * self.max_num_seqs * math.ceil(longest / self.block_size)
        return EngineConfig(
            model=str(model_dir), max_loras=self.max_loras, max_cpu_loras=self.max_cpu_loras,
            max_lora_rank=32, block_size=self.block_size, num_kv_blocks=blocks,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
            async_scheduling=self.async_scheduling)

    def bound_terms(self) -> tuple[int, int, int]:
        """(K, D, L) of the scheduler's bound for this configuration."""
        s, b = self.max_num_seqs, self.max_num_batched_tokens
        d = math.ceil(s * max(PROMPT_LENS) / (b - s + 1)) + self.max_tokens
        return SchedulerConfig().starvation_steps, d + self.async_scheduling, 3


def prompts(vocab: int = 300, seed: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def references(model_dir, weights: dict[str, Path], max_tokens: int) -> dict:
    """Tokens per (weights key or None for the base model, prompt index), on an engine of
    their own, one adapter at a time (a request's tokens do not depend on its batch:
    tests/test_engine_parity.py)."""
    eng = Engine(EngineConfig(model=str(model_dir), max_loras=1, max_lora_rank=32))
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    refs, ps = {}, prompts()
    try:
        for key, path in [(None, None), *weights.items()]:
            if path is not None:
                eng.add_adapter(key, path)
            for i, out in enumerate(eng.generate(ps, greedy, [key] * len(ps))):
                refs[key, i] = out.token_ids
    finally:
        eng.close()
    return refs


@dataclass
class Live:
    """A request the model expects to finish."""
    prompt: int
    adapter_id: int
    max_tokens: int
    req: object
    arrival: int        # scheduler step at arrival
    bound: int          # steps it may wait for admission (before admin pins)
    pin_ops: int        # admin pins before its arrival
    admitted: bool = False


@dataclass
class Stats:
    ops: Counter = field(default_factory=Counter)
    finished: int = 0
    aborted: int = 0
    refused: int = 0
    max_wait: int = 0
    max_wait_share: float = 0.0  # largest wait / its bound
    steps: int = 0


class LifecycleStress:
    def __init__(self, cfg: StressConfig, model_dir, weights: dict[str, Path], refs: dict,
                 seed: int):
        self.cfg, self.weights, self.refs, self.seed = cfg, weights, refs, seed
        self.rng = random.Random(seed)
        self.eng = Engine(cfg.engine_config(model_dir))
        self.prompts = prompts()
        self.version: dict[int, str] = {}              # adapter id -> weights key
        self.current: dict[str, tuple[int, bool]] = {}  # name -> (id, retiring)
        self.pinned: dict[int, tuple[int, int]] = {}    # id -> (evictions, host evictions)
        self.live: dict[str, Live] = {}
        self.pin_ops = 0
        self.stream: str | None = ""  # adapter name of the hot stream ("": none)
        self.last_id = 0
        self.stats = Stats()
        self.tiers_seen: set[str] = set()
        self.K, self.D, self.L = cfg.bound_terms()

    def close(self) -> None:
        self.eng.close()

    # ---- the run ------------------------------------------------------------------
    def run(self, num_ops: int, log_every: int = 0) -> Stats:
        """`num_ops` random operations, then drain and check the idle state. Any failure
        is re-raised naming the seed and the operation, so the run can be replayed."""
        op = "start"
        try:
            weights = MIXED
            for i in range(num_ops):
                if i % PHASE_OPS == 0:
                    weights = self.rng.choice((MIXED, TRAFFIC))
                    self.stream = self._hot_name() if weights is TRAFFIC else ""
                op = self.rng.choices(OPS, weights)[0]
                getattr(self, f"_{op}")(self.rng.choice(self.cfg.names), f"q{i}")
                self.stats.ops[op] += 1
                self._check()
                if log_every and (i + 1) % log_every == 0:
                    print(f"  {i + 1} ops, {self.stats.steps} steps, {self.stats.finished} "
                          f"finished, max wait {self.stats.max_wait} steps", flush=True)
            op, self.stream = "drain", ""
            self._drain_and_check_idle()
        except Exception as err:
            raise AssertionError(
                f"lifecycle stress failed at {op} ({self.cfg}, seed={self.seed}, after "
                f"{sum(self.stats.ops.values())} ops): {err!r}; replay with "
                f"benchmarks/stress_lifecycle.py --seed {self.seed}") from err
        return self.stats

    # ---- operations ---------------------------------------------------------------
    def _can_pin(self, aid: int | None) -> bool:
        others = set(self.pinned) - {aid}
        return len(others) + 1 < self.cfg.max_loras

    def _pin_model(self, aid: int, on: bool) -> None:
        if on and aid not in self.pinned:
            st = self.eng.stats()["adapters"][aid]
            self.pinned[aid] = (st["evictions"], st["host_evictions"])
        elif not on:
            self.pinned.pop(aid, None)

    def _add(self, name: str, key: str) -> None:
        have = self.current.get(name)
        pin = self.rng.random() < 0.2
        if pin and not self._can_pin(have[0] if have else None):
            with _raises(CapacityError, "one must stay dynamic"):
                self.eng.add_adapter(name, self.weights[key], pinned=True)
            self.stats.refused += 1
            return
        if pin or self.last_id % 2:
            aid = self.eng.add_adapter(name, self.weights[key], pinned=pin)
        else:  # every other load as the engine server makes it past a full host tier:
            # checked, registered on disk, read at first use (no RNG drawn for the choice)
            read = self.eng.read_adapter(name, self.weights[key], lazy=True)
            assert read.weights is None
            aid = self.eng.register_adapter(read)
        assert aid > self.last_id, "ids are never reused"
        self.last_id, self.version[aid] = aid, key
        self.pin_ops += pin
        if have:
            self._pin_model(have[0], False)
        self.current[name] = (aid, False)
        self._pin_model(aid, pin)

    def _load(self, name: str, _rid: str) -> None:
        self._add(name, self.rng.choice(sorted(self.weights)))

    def _reload(self, name: str, _rid: str) -> None:
        have = self.current.get(name)
        keys = sorted(self.weights)
        if have is not None and not have[1]:  # new weights under the same name
            keys.remove(self.version[have[0]])
        self._add(name, self.rng.choice(keys))

    def _unload(self, name: str, _rid: str) -> None:
        have = self.current.get(name)
        if have is None:
            with _raises(AdapterNotFoundError, "is not loaded"):
                self.eng.remove_adapter(name)
            self.stats.refused += 1
            return
        assert self.eng.remove_adapter(name) == have[0]
        self._pin_model(have[0], False)
        self.current[name] = (have[0], True)

    def _pin(self, name: str, _rid: str, on: bool = True) -> None:
        have = self.current.get(name)
        if have is None or have[1]:
            with _raises((AdapterNotFoundError, AdapterUnavailableError), ""):
                self.eng.set_adapter_pinned(name, on)
            self.stats.refused += 1
            return
        if on and have[0] not in self.pinned and not self._can_pin(have[0]):
            with _raises(CapacityError, "one must stay dynamic"):
                self.eng.set_adapter_pinned(name, True)
            self.stats.refused += 1
            return
        self.eng.set_adapter_pinned(name, on)
        self.pin_ops += on
        self._pin_model(have[0], on)

    def _unpin(self, name: str, rid: str) -> None:
        self._pin(name, rid, on=False)

    def _hot_name(self) -> str | None:
        """Traffic is skewed: the base model, a few hot adapters, a tail of cold ones."""
        names = self.cfg.names
        if self.rng.random() < 0.15:
            return None
        return self.rng.choices(names, [1 / (i + 1) for i in range(len(names))])[0]

    def _burst(self, _name: str, rid: str) -> None:
        """Requests for one adapter, up to the live limit: the hot traffic that used to
        keep a cold adapter's disk read from ever starting."""
        use = self._hot_name()
        for i in range(self.rng.randint(2, self.cfg.max_num_seqs)):
            self._request(use, f"{rid}.{i}", use)

    def _request(self, _name: str, rid: str, use: str | None = "") -> None:
        if len(self.live) >= self.cfg.max_num_seqs:
            return  # the bound assumes no wait for a sequence slot
        use = self._hot_name() if use == "" else use
        have = self.current.get(use) if use else None
        p = self.rng.randrange(len(self.prompts))
        n = self.rng.randint(1, self.cfg.max_tokens)
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        if use is not None and (have is None or have[1]):
            err = AdapterNotFoundError if have is None else AdapterUnavailableError
            with _raises(err, use):
                self.eng.add_request(rid, self.prompts[p], params, use)
            self.stats.refused += 1
            return
        aid = have[0] if use else 0
        ahead = {t.adapter_id for t in self.live.values() if not t.admitted} - {0, aid}
        bound = self.K + (len(ahead) + 1) * (self.D + self.L)
        self.eng.add_request(rid, self.prompts[p], params, use)
        self.live[rid] = Live(p, aid, n, self.eng.scheduler.get(rid),
                              self.eng.scheduler.num_steps, bound, self.pin_ops)

    def _abort(self, _name: str, _rid: str) -> None:
        if self.live:
            rid = self.rng.choice(sorted(self.live))
            assert self.eng.abort(rid)
            self._finished(rid)

    def _step(self, _name: str = "", rid: str = "") -> None:
        if self.stream != "":
            self._request("", f"{rid}.s", self.stream)
        for out in self.eng.step():
            if out.finished:
                self._finished(out.request_id)
        self.stats.steps += 1
        self.eng.adapters.loader.wait_all()  # reads land by the next step's poll

    # ---- checks -------------------------------------------------------------------
    def _finished(self, rid: str) -> None:
        t = self.live.pop(rid)
        r = t.req
        ref = self.refs[self.version.get(t.adapter_id), t.prompt][:t.max_tokens]
        if r.finish_reason == FinishReason.ABORTED:
            assert r.output_token_ids == ref[:len(r.output_token_ids)], rid
            self.stats.aborted += 1
        else:
            assert r.finish_reason == FinishReason.LENGTH, (rid, r.finish_reason)
            assert r.output_token_ids == ref, (rid, r.output_token_ids, ref)
            self.stats.finished += 1
        assert r.num_preemptions == 0, "preempted: the bound's preconditions do not hold"

    def _check(self) -> None:
        eng, st = self.eng, self.eng.stats()
        now = eng.scheduler.num_steps
        for rid, t in self.live.items():
            waited = now - t.arrival
            if not t.admitted and t.req.status is not RequestStatus.WAITING:
                t.admitted = True
                self.stats.max_wait = max(self.stats.max_wait, waited)
                self.stats.max_wait_share = max(self.stats.max_wait_share, waited / t.bound)
            bound = t.bound + self.L * (self.pin_ops - t.pin_ops)
            assert t.admitted or waited <= bound, \
                f"request {rid} (adapter {t.adapter_id}) waited {waited} steps > bound {bound}"
        assert st["slots_used"] <= eng.slots.num_slots
        assert st["host_copies"] <= eng.adapters.host.capacity
        for aid, (ev, host_ev) in self.pinned.items():
            a = st["adapters"][aid]
            assert (a["evictions"], a["host_evictions"]) == (ev, host_ev), \
                f"pinned adapter {aid} was evicted"
        draining = Counter(r.adapter_id for r in eng.scheduler.draining())
        live = Counter(t.adapter_id for t in self.live.values())
        for aid, a in st["adapters"].items():
            assert a["in_flight"] == live[aid] + draining[aid], aid
        eng.kv.pool.check_invariants()
        for name, (aid, retiring) in list(self.current.items()):
            if retiring and aid not in st["adapters"]:  # retired and drained
                assert live[aid] == 0
                del self.current[name]
        for a in st["adapters"].values():
            self.tiers_seen |= {k for k in ("evictions", "host_evictions", "disk_reads") if a[k]}

    def _drain_and_check_idle(self) -> None:
        eng = self.eng
        limit = self.K + (len(self.cfg.names) + 2) * (self.D + self.L) * 2
        for _ in range(limit):
            if not eng.has_unfinished():
                break
            self._step()
            self._check()
        assert not eng.has_unfinished() and not self.live, "requests left after the drain"
        eng.step()  # idle: pending evictions flushed
        st = eng.stats()
        assert st["pending_evictions"] == 0 and st["free_kv_blocks"] == st["num_kv_blocks"]
        assert all(b.ref_cnt == 0 for b in eng.kv.pool.blocks)
        assert all(a["in_flight"] == 0 and not a["unloading"] for a in st["adapters"].values())
        assert eng.scheduler.running_adapters() == set() and eng.scheduler.draining() == []
        # back to the baseline: unload every name, nothing of an adapter is left
        for name, (_aid, retiring) in sorted(self.current.items()):
            if not retiring:
                eng.remove_adapter(name)
        eng.step()
        st = eng.stats()
        assert st["adapters"] == {} and st["slots_used"] == 0 and st["host_copies"] == 0
        assert set(eng.kv.pool.cache.namespaces()) <= {0}
        assert list(eng.pins) == []


class _raises:
    """Like pytest.raises (the benchmark runs without pytest): the block must raise one
    of `types` with `words` in its message."""

    def __init__(self, types, words: str):
        self.types, self.words = types, words

    def __enter__(self):
        return self

    def __exit__(self, typ, exc, tb):
        assert typ is not None and issubclass(typ, self.types), f"expected {self.types}"
        assert self.words in str(exc), (self.words, str(exc))
        return True
