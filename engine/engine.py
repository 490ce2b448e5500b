"""The engine: one model, many adapters, a paged KV cache and a step loop.

Step-level API (what the engine server drives): `add_request`, `step`, `abort`,
`has_unfinished`, `flush`, `add_adapter`, `remove_adapter`, `stats`. `generate` is the
offline convenience on top of it. The parts are built in engine/assembly.py, request
checks live in engine/admission.py, adapter operations in engine/adapters/service.py (pins
in engine/adapters/pins.py), where a step runs (this process, or a tensor-parallel group)
in engine/executor.py, and text, logprobs and stop checks in engine/output_processor.py.
One step: schedule (engine/scheduler.py), launch through the executor, read the tokens,
append them (scheduler.update), let the output processor decide who stops.

Async scheduling (`EngineConfig.async_scheduling`). A sync step schedules, runs the
forward pass, waits for the sampled tokens and updates the requests; the device idles
while the host schedules and updates. An async step instead schedules step N+1 while step
N is still on the device, launches it (its inputs that N is sampling come from N's token
tensor on the device, see engine/runner.py), and only then waits for N's tokens, updates
the requests with them and returns N's outputs: the device always has the next step
queued while the host works. Tokens, logprobs and finish reasons are those of sync mode;
what the scheduler does with in-flight tokens and with requests that finish while a
launched step still holds them is in engine/scheduler.py. A step falls back to sync
(completes the step in flight before scheduling) when that step sampled a request whose
sampler reads the token history (repetition penalty); under tensor parallelism every
rank holds every step's tokens on its device (engine/distributed/executor.py), so the
same steps overlap there. A request id still held by the
step in flight is reused only after that step completes (add_request completes it).
A step that samples a constrained request (engine/structured/) needs the previous step's
tokens in the matchers before its mask is filled: its launch queues the forward pass,
then (the runner calls the mask source) completes the step in flight, advances the
matchers, fills the mask while the forward pass runs, and only then queues the sampling.
Nothing else needs a quiescent device: KV blocks are only written by work queued on the
compute stream, in order, and an adapter copy into a slot waits on the device for the
last launched step that read that slot (engine/adapters/copier.py).
"""
from __future__ import annotations

import itertools
import time
from collections import Counter
from pathlib import Path

import torch

from loramux_engine.adapters.pins import Pins
from loramux_engine.adapters.service import ReadAdapter
from loramux_engine.adapters.slots import SlotTable
from loramux_engine.admission import (AdmissionLimits, check_generated, check_length, check_request,
                              prompt_token_ids, sequence_ids)
from loramux_engine.assembly import build_adapter_parts, build_model_parts, max_model_len
from loramux_engine.config import EngineConfig
from loramux_engine.distributed.executor import make_executor
from loramux_engine.kv.kv_cache_manager import KVCacheManager
from loramux_core.model.hf_config import ModelConfig
from loramux_engine.output_processor import OutputProcessor
from loramux_engine.outputs import FinishReason, RequestOutput, StepOutput
from loramux_engine.pending import PendingSample
from loramux_engine.request import Request
from loramux_engine.resolve import MachineFacts, describe, resolve_config
from loramux_engine.sampling import RequestSeeds, SamplingState
from loramux_engine.scheduler import Sampled, Scheduler, SchedulerConfig, SchedulerOutput
from loramux_engine.structured import CompilerConfig, Grammars
from loramux_engine.telemetry import BATCH_SIZES, STEP_SECONDS, Histogram
from loramux_engine.startup import StartupProgress
from loramux_engine.warmup import WarmupPlan, WarmupReport
from loramux_core.errors import AdapterUnavailableError, EngineDeadError, InvalidRequestError
from loramux_core.sampling import SamplingParams
from loramux_core.tokenizer import Tokenizer

_GRAMMAR_POLL_S = 0.02  # an idle step's wait for a compile (the server loop reads inputs)

class Engine:
    def __init__(self, config: EngineConfig):
        """`config`'s automatic values are resolved first (engine/resolve.py);
        `self.config` is the resolved config."""
        self.model_config = ModelConfig.from_dir(config.model)
        config = resolve_config(config, self.model_config, MachineFacts.probe(config.device))
        self.config = config
        # tp_size > 1: this process is rank 0; the executor spawns ranks 1..N-1 and
        # mirrors every step and adapter change to them (engine/distributed/executor.py)
        self.executor = make_executor(config)
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise

    def _build(self, config: EngineConfig) -> None:
        self.device = torch.device(config.device)
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.tokenizer = Tokenizer.from_dir(config.model)
        mc = self.model_config
        self.max_model_len = max_model_len(config, mc)
        parts = build_model_parts(config, mc, self.device, self.executor.tp,
                                  self.executor.agree_min)
        self.model, self.lora_pool, self.runner = parts.model, parts.lora_pool, parts.runner
        self.num_kv_blocks = parts.num_kv_blocks
        self.adapter_loaders = parts.loaders  # loader processes (None: reads in-process)
        # host buffers made ahead for the first loads (engine/lora/host_reserve.py)
        self.host_reserve = parts.host_reserve
        self.host_buffers = parts.host_buffers
        self.kv = KVCacheManager(self.num_kv_blocks, config.block_size,
                                 config.enable_prefix_caching)
        self.pins = Pins(config.max_loras)  # the one owner of pin state
        self.slots = SlotTable(config.max_loras, self.pins)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            config.max_loras),
            self.kv, self.slots, on_release=self._on_released)
        self._async = config.use_async_scheduling
        self._inflight: tuple[SchedulerOutput, PendingSample] | None = None
        self._carry: list[StepOutput] = []  # outputs of a step completed outside step()
        self.registry, self.adapters, self.adapter_service = build_adapter_parts(
            config, parts, self.device, self.executor, self.slots, self.pins, self.kv)
        self.scheduler.reading = self.adapters.loader.is_pending  # not starving meanwhile
        self._limits = AdmissionLimits(mc.vocab_size, self.max_model_len, self.num_kv_blocks,
                                       config.block_size)
        self._seeds = RequestSeeds(config.seed)
        self._arrival = itertools.count()
        self._generate_batches = itertools.count()
        self._forks: dict[str, list[str]] = {}  # request id (n > 1) -> its sequence ids
        self.outputs = OutputProcessor(
            self.tokenizer, frozenset(self.tokenizer.eos_token_ids or mc.eos_token_ids),
            self.max_model_len)
        self.grammars = Grammars(
            CompilerConfig(Path(config.model) / "tokenizer.json",
                           max(mc.vocab_size, self.tokenizer.vocab_size),
                           tuple(sorted(self.outputs.eos_token_ids))),
            config.max_num_seqs, pin=self.device.type == "cuda")
        self.step_seconds = Histogram("step_seconds", STEP_SECONDS)
        self.batch_sizes = Histogram("batch_size", BATCH_SIZES)  # sequences per forward pass
        if self.host_reserve is not None:   # last: nothing after it can fail the build
            # page-locking is paced while requests run (the step's launches wait for the
            # driver's lock it holds), back to back while none does
            self.host_reserve.start(busy=self.scheduler.has_unfinished)

    # ---- adapters ---------------------------------------------------------------
    def add_adapter(self, name: str, path: str | Path, pinned: bool = False,
                    version: str | None = None) -> int:
        """Validate and read a PEFT adapter into host memory; returns its new id (a new
        one on every call, also for a name already loaded: see AdapterRegistry). It is
        copied into a device slot when a request (or a pin) needs it. `path` must lie in
        the configured adapter roots; `version`, when given, is the content version the
        files must have. Raises AdapterError (nothing registered; AdapterPathError,
        AdapterChangedError) or CapacityError (a pin would take the last dynamic slot)."""
        return self.adapter_service.add(name, path, pinned, version)

    def read_adapter(self, name: str, path: str | Path,
                     version: str | None = None, lazy: bool = False) -> ReadAdapter:
        """The disk half of add_adapter: read and validate `path` for `name` (of
        `version`, when given), changing nothing in the engine, so it may run on any
        thread while steps go on (the engine server reads admin loads this way). Raises
        AdapterError. `lazy`: check all that needs no weights (config, header, shapes,
        dtypes, file size) and leave the weights on disk, read and checked in full (values,
        version) when a request first needs them: for a host tier with no free place, where
        the copy would only displace another."""
        return self.adapter_service.read(name, path, version, lazy)

    def host_copies_free(self) -> int:
        """Places in the host tier that no copy holds and no pending read will take."""
        a = self.adapters
        return a.host.capacity - len(a.host) - a.loader.num_pending

    def register_adapter(self, read: ReadAdapter, pinned: bool = False) -> int:
        """The other half, on the step thread: register what read_adapter returned under
        its name as a new version (see add_adapter). Raises CapacityError for a pin."""
        return self.adapter_service.register(read, pinned)

    def set_adapter_pinned(self, name: str, pinned: bool) -> int:
        """Pin (never evicted implicitly from a slot or host memory; brought into a slot at
        the next step) or unpin the current version of `name`."""
        return self.adapter_service.set_pinned(name, pinned)

    def adapter_pinned(self, adapter_id: int) -> bool:
        """Whether the version `adapter_id` is pinned now."""
        return adapter_id in self.pins

    def remove_adapter(self, name: str) -> int:
        """Unload `name`: refused for new requests at once; its slot, host copy and KV
        namespace are freed when its in-flight requests end (they finish with the weights
        they started with). Afterwards the name is unknown (AdapterNotFoundError)."""
        return self.adapter_service.remove(name)

    def _advance_adapters(self) -> list[StepOutput]:
        """Finished reads and copies move along the tiers. A version whose files changed
        or vanished since it was loaded cannot be read back: its waiting requests end with
        FinishReason.ERROR and the version is retired."""
        results = []
        for res in self.adapters.poll():
            rec = self.registry.get(res.adapter_id)
            why = AdapterUnavailableError(
                f"adapter {rec.name!r} cannot be served: reading its weights failed: "
                f"{res.error}")
            for req in [r for r in self.scheduler.waiting if r.adapter_id == res.adapter_id]:
                results.append(self._fail_waiting(req, why))
            self.adapter_service.retire(res.adapter_id)
        self.adapter_service.free_retired()
        return results

    def _fail_waiting(self, req: Request, why: Exception) -> StepOutput:
        """End a waiting request with FinishReason.ERROR and `why` for its caller."""
        self.scheduler.finish(req, FinishReason.ERROR)  # (a preempted one may drain)
        out = self.outputs.step_output(req, new_token=False)
        out.error = why
        self._on_finished(req)
        return out

    def _schedule(self, results: list[StepOutput]) -> tuple[SchedulerOutput, bool]:
        """Schedule one batch, then prefetch; also says whether a slot became ready."""
        results += self._advance_adapters()
        # a constraint refused or too slow to compile: its request ends here, alone
        results += [self._fail_waiting(req, req.grammar.error)
                    for req in self.grammars.settle()]
        out = self.scheduler.schedule()
        # the batch is fixed: bring in what waiting requests (and pins) need, evicting only
        # adapters without running requests; copies overlap this step's forward pass
        wanted = self.scheduler.wanted_adapters()
        wanted += self.adapter_service.pinned_to_load(wanted)
        ready = self.adapters.prefetch(wanted, busy=self.scheduler.running_adapters())
        return out, ready

    # ---- requests ---------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    adapter: str | None = None, generated: list[int] = ()) -> None:
        """Validate and queue a request. Raises (nothing queued) InvalidRequestError,
        PromptTooLongError, AdapterNotFoundError or AdapterUnavailableError.

        `generated`: a resumed request's tokens, generated by an engine that went away
        and already delivered: they follow the prompt as context (prefilled again, through
        the prefix cache where it holds them) and count as generated for max_tokens, stop
        strings and sampling positions, so the outputs continue where they ended."""
        check_request(request_id, params, self._limits)
        prompt_ids = prompt_token_ids(prompt, self.tokenizer, self._limits)
        check_length(len(prompt_ids), params.max_tokens, self._limits)
        generated = check_generated(generated, params, self._limits)
        adapter_id = self.registry.resolve(adapter)
        ids = sequence_ids(request_id, params.n)
        if any(self.scheduler.is_draining(r) for r in ids):
            self._carry += self._complete()  # the step in flight still holds the id
        if request_id in self._forks or any(self.scheduler.get(r) is not None for r in ids):
            raise InvalidRequestError(f"request_id={request_id!r}: already in use")
        seed = self._seeds.next()
        for i, rid in enumerate(ids):
            self._queue(Request(rid, prompt_ids, params, adapter_id=adapter_id,
                                arrival=next(self._arrival),
                                parent_id=request_id if params.n > 1 else None),
                        seed, i, generated)
        if params.n > 1:
            self._forks[request_id] = ids

    def _queue(self, req: Request, seed: int, index: int, generated: list[int]) -> None:
        for token in generated:
            req.append_token(token)
        self.outputs.add(req)
        req.sampling_state = SamplingState.create(req.params, req.prompt_token_ids,
                                                  default_seed=seed, sample_index=index)
        req.sampling_state.output_token_ids.extend(generated)
        self.grammars.attach(req)
        self.registry.acquire(req.adapter_id)
        self.scheduler.add(req)

    def abort(self, request_id: str) -> bool:
        """Stop a waiting or running request (all n sequences of it) and free all it
        holds (when the step in flight that holds it completes, if any: async
        scheduling); False if unknown or already finished."""
        found = False
        for rid in self._forks.get(request_id, [request_id]):
            req = self.scheduler.abort(rid)
            if req is not None:
                found = True
                self._on_finished(req)
        return found

    def has_unfinished(self) -> bool:
        """Requests waiting or running, a step in flight, or outputs not yet returned."""
        return self.scheduler.has_unfinished() or self._inflight is not None or bool(self._carry)

    def flush(self) -> list[StepOutput]:
        """Complete the step in flight, if any, and return every output step() has not
        returned yet; afterwards nothing is in flight and every finished request has
        freed what it held."""
        results, self._carry = self._carry, []
        if self._inflight is not None:
            results += self._complete()
        self.adapter_service.free_retired()
        return results

    # ---- the step loop ----------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Schedule and launch one forward pass; returns the outputs (one StepOutput per
        request that got a token or finished) of the step completed in this call: the
        one just launched (sync), or the one launched by the previous call (async)."""
        t0 = time.perf_counter()
        results = self._step()
        self.step_seconds.observe(time.perf_counter() - t0)
        return results

    def _step(self) -> list[StepOutput]:
        # host copies the collector found since the last step, possibly inside this
        # thread's graph capture, go back to their pool here (engine/releases.py)
        self.host_buffers.collect()
        results, self._carry = self._carry, []
        inflight = self._inflight
        if inflight is not None and self.executor.must_read_before_next(inflight[1]):
            results += self._complete()  # sync fallback: see the module docstring
        out = self._schedule_step(results)
        if out.is_empty:
            if self._inflight is not None:
                results += self._complete()
            self.adapter_service.free_retired()
            return results
        self.batch_sizes.observe(len(out.scheduled))
        for req, hits in out.cache_hits:
            self.adapter_service.count_cache_hits(req.adapter_id, hits)
        # slots loaded for this batch may still be copying: the step waits on the device
        self.adapters.order_before_step({s.request.adapter_id for s in out.scheduled
                                         if s.slot >= 0})
        prev = self._inflight  # always None in sync mode
        pending = prev[1] if prev else None
        masks = self._mask_source(out, results)
        launched = self.executor.launch(out, self.runner, pending, masks)
        # a copy that later overwrites one of these slots waits for this step (no sync)
        self.adapters.note_step_reads({s.slot for s in out.scheduled})
        if self._inflight is not None:  # prev, unless the mask source completed it
            results += self._complete()
        self._inflight = (out, launched)
        if not self._async or not self.scheduler.has_unfinished():
            results += self._complete()  # sync; or only finished requests left in it
        self.adapter_service.free_retired()
        return results

    def _schedule_step(self, results: list[StepOutput]) -> SchedulerOutput:
        out, ready = self._schedule(results)
        if self._inflight is not None:
            return out  # if empty, completing the step in flight is the progress
        for _ in range(3):  # disk -> host, host -> slot, admit
            # nothing could run: waiting for an adapter or a compile now delays no other
            # request
            if not out.is_empty or not (ready or self.adapters.wait_pending()
                                        or self.grammars.wait(_GRAMMAR_POLL_S)):
                break
            out, ready = self._schedule(results)
        return out

    def _mask_source(self, out: SchedulerOutput, results: list[StepOutput]):
        """What the runner calls, once the step's forward pass is queued, for the token
        bitmask of its constrained rows: the step in flight (async scheduling) completes
        first, into `results`, so its tokens are in the matchers. None: none samples."""
        if not any(s.samples and s.request.grammar is not None for s in out.scheduled):
            return None

        def fill(requests: list[Request]):
            if self._inflight is not None:
                results.extend(self._complete())
            return self.grammars.fill(requests)
        return fill

    def _complete(self) -> list[StepOutput]:
        """Wait for the tokens of the step in flight and update the requests with them."""
        out, pending = self._inflight
        self._inflight = None
        return self._update(out, self.executor.result(pending))

    def _update(self, out: SchedulerOutput, sampled: dict[str, Sampled]) -> list[StepOutput]:
        """Append a completed step's tokens; the output processor says who stops."""
        results = []
        for req in self.scheduler.update(out, sampled):
            # the runner counted the token in the sampler state at launch; write it in
            req.sampling_state.output_token_ids[req.num_output_tokens - 1] = req.all_token_ids[-1]
            reason = self.outputs.append(req, sampled[req.request_id])
            error = None
            if req.grammar is not None:
                reason, error = self.grammars.accept(req, reason)
            if reason is not None:
                self.scheduler.finish(req, reason)
                self._on_finished(req)
            results.append(self.outputs.step_output(req))
            results[-1].error = error
        return results

    def _on_finished(self, req: Request) -> None:
        forks = self._forks.get(req.parent_id) if req.parent_id is not None else None
        if forks and all(self.scheduler.get(rid) is None for rid in forks):
            del self._forks[req.parent_id]

    def _on_released(self, req: Request) -> None:
        """The scheduler freed the request's blocks: let go of its adapter reference."""
        self.registry.release(req.adapter_id)
        self.adapter_service.free_retired()

    # ---- offline convenience ----------------------------------------------------
    def generate(self, prompts, sampling: SamplingParams | list[SamplingParams] | None = None,
                 adapters: list[str | None] | None = None) -> list[RequestOutput]:
        """Run `prompts` to completion; outputs in prompt order. `sampling`: one
        SamplingParams for all (default: SamplingParams()) or one per prompt; `adapters`:
        None (all base) or one name (None = base) per prompt. A prompt with n > 1 gives n
        consecutive outputs (ids "<id>/<i>"). Steps the engine until these
        requests finish (other requests in the engine advance too). If any request is
        refused, none of them runs."""
        n = len(prompts)
        params = sampling if isinstance(sampling, list) else [sampling or SamplingParams()] * n
        names = adapters if adapters is not None else [None] * n
        if len(params) != n or len(names) != n:
            raise InvalidRequestError(
                f"{n} prompts need as many sampling params ({len(params)}) and adapters "
                f"({len(names)})")
        batch = next(self._generate_batches)
        ids = [f"generate-{batch}-{i}" for i in range(n)]
        reqs, added = [], []
        try:
            for rid, prompt, p, name in zip(ids, prompts, params, names):
                self.add_request(rid, prompt, p, name)
                added.append(rid)
                reqs += [self.scheduler.get(sid) for sid in self._forks.get(rid, [rid])]
        except Exception:
            for rid in added:
                self.abort(rid)
            raise
        while any(not r.is_finished for r in reqs):
            self.step()
        return [self.outputs.request_output(r) for r in reqs]

    # ---- lifetime ---------------------------------------------------------------
    def close(self) -> None:
        """Complete the step in flight (its outputs are dropped: call flush() first to
        keep them), stop the background adapter reader and join the other tensor-parallel
        ranks (the engine is unusable afterwards; at TP > 1 a later step raises
        EngineDeadError)."""
        if getattr(self, "_inflight", None) is not None:
            try:
                self.flush()
            except EngineDeadError:  # a rank is gone (TP): the step's outputs with it
                self._inflight = None
        if getattr(self, "host_reserve", None) is not None:
            self.host_reserve.close()
        if getattr(self, "grammars", None) is not None:
            self.grammars.close()
        if getattr(self, "adapters", None) is not None:
            self.adapters.loader.close()
        if getattr(self, "host_buffers", None) is not None:   # after the last read
            self.host_buffers.close()
        executor = getattr(self, "executor", None)
        # a lost rank: a step's NCCL kernels may spin on this device until the
        # communicator is aborted (executor.close), so nothing here waits for the device
        dead = executor is not None and executor.dead
        if getattr(self, "runner", None) is not None:
            # before NCCL's teardown (CudaGraphRunner.release)
            self.runner.release_graphs(wait=not dead)
        if executor is not None:
            executor.close()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def warm_up(self, progress: StartupProgress | None = None, force: bool = False,
                only=None, on_shape=None, this_rank: bool = False) -> WarmupReport | None:
        """Compile every kernel variant and capture every CUDA graph the limits can reach
        (engine/warmup.py), before any request, telling `progress` how far it is; None
        where there is nothing to compile (the CPU runs torch references; `force`: run
        it there all the same). `only`, `on_shape`: as loramux_engine.warmup.warm_up's (the
        eager shapes a parallel compile found covering).
        Under tensor parallelism every rank runs it in step (Executor.warm_up); a failure
        there is EngineDeadError. `this_rank`: rank 0 alone, its collectives skipped
        (TPGroup.without_peers): a dry run, whose outputs mean nothing."""
        if self.device.type != "cuda" and not force:
            return None
        assert not self.scheduler.has_unfinished(), "warm up before serving requests"
        c = self.config
        reserve = self.host_reserve
        if reserve is not None:
            # no page-locking meanwhile: compiles and graph captures take the driver's
            # lock often, and the start would take longer (it is safe: captures are
            # thread_local, engine/cuda_graph.py)
            reserve.hold()
        try:
            plan = WarmupPlan.of(self.runner, self.num_kv_blocks, c.block_size,
                                 c.max_num_seqs, c.max_num_batched_tokens,
                                 self.max_model_len, only)
            if this_rank:
                with self.executor.tp.without_peers():
                    return plan.run(self.runner, progress, on_shape)
            return self.executor.warm_up(self.runner, plan, progress, on_shape)
        finally:
            if reserve is not None:
                reserve.resume()

    def describe(self) -> str:
        """The resolved configuration in one line (the server logs it at start-up)."""
        return describe(self.config, self.num_kv_blocks, self.max_model_len)

    def stats(self) -> dict:
        """Counters for the control plane and metrics. Per engine: KV blocks (total,
        free), queue lengths, slots used, host copies, pending evictions (retired versions
        still draining), the host reserve's buffers (host_reserve_target, _ready, _taken:
        engine/lora/host_reserve.py; absent without one). Per adapter version (keyed by
        id): name, path, rank, content version, state ("slot" ready in a device slot,
        "host", or "disk"), slot, pinned, unloading, in-flight requests, slot loads and
        evictions, disk reads, host evictions and cached-token hits."""
        return {
            "num_kv_blocks": self.num_kv_blocks, "free_kv_blocks": self.kv.num_free_blocks,
            "running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
            "slots_used": self.slots.num_used, "host_copies": len(self.adapters.host),
            "pending_evictions": self.registry.num_retiring,
            "base_cached_token_hits": self.adapter_service.base_cache_hits,
            "max_loras": self.config.max_loras,
            **(self.host_reserve.counters() if self.host_reserve is not None else {}),
            "adapters": self._adapter_stats()}

    def _adapter_stats(self) -> dict[int, dict]:
        """AdapterService.stats with each version's running and waiting request counts."""
        running = Counter(r.adapter_id for r in self.scheduler.running)
        waiting = Counter(r.adapter_id for r in self.scheduler.waiting)
        adapters = self.adapter_service.stats()
        for aid, entry in adapters.items():
            entry["running"], entry["waiting"] = running[aid], waiting[aid]
        return adapters

    def histograms(self) -> list[Histogram]:
        """Step time, batch size, disk reads and slot loads since the engine started."""
        return [self.step_seconds, self.batch_sizes, self.adapters.disk_read_seconds,
                self.adapters.slot_load_seconds]
