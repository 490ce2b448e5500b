"""GenerateService over grpc.aio: validate, resolve the adapter, admit, stream.

The engine detokenizes (engine/detokenizer.py, the same incremental detokenizer the offline
engine uses) because stop strings are decided on text and must stop the request inside the
engine at the step they appear; the gateway forwards each step's text delta as is, so a
stream's text is exactly the offline engine's text, and multi-byte characters arrive whole."""
from __future__ import annotations

import asyncio
import contextlib
import time

import grpc
import structlog
from loramux.v1 import generate_pb2, generate_pb2_grpc

from loramux_core.v1 import engine_pb2
from loramux_services.common import rich_status
from loramux_services.gateway.adapter_table import AdapterTable
from loramux_services.gateway.engine_client import EngineClient
from loramux_services.gateway.errors import Rejected
from loramux_services.gateway.grpc_tools import calls_for, expand_tag, refused_as
from loramux_services.gateway.metrics import GatewayMetrics
from loramux_services.gateway.prompts import PromptBuilder
from loramux_services.gateway.tool_calls import FORMATS, CallFormat, detect_format
from loramux_services.gateway.validation import check_sampling


class _Stream:
    """Timing and counting for one call."""

    def __init__(self, adapter: str, label: str):
        self.adapter = adapter
        self.label = label  # the adapter's metrics label (bounded, see GatewayMetrics)
        self.t0 = time.monotonic()
        self.first: float | None = None
        self.last = self.t0
        self.tokens = 0
        self.prompt_tokens = 0


class GenerateServicer(generate_pb2_grpc.GenerateServiceServicer):
    def __init__(self, engine: EngineClient, table: AdapterTable, prompts: PromptBuilder,
                 metrics: GatewayMetrics, default_max_model_len: int,
                 tool_call_parser: str = "auto"):
        """`tool_call_parser`: the format tool calls are parsed in under tool_choice
        "auto" (tool_calls.PARSER_NAMES); "auto": the one the chat template shows."""
        self.engine, self.table, self.prompts = engine, table, prompts
        self.metrics = metrics
        self.default_max_model_len = default_max_model_len
        self.tool_call_parser = tool_call_parser
        self._log = structlog.get_logger()

    async def call_format(self, adapter: str) -> CallFormat | None:
        """The format the model answering for `adapter` writes tool calls in."""
        if self.tool_call_parser != "auto":
            return FORMATS.get(self.tool_call_parser)
        entry = await self.table.resolve_current(adapter) if adapter else None
        return detect_format(await self.prompts.template_source(entry))

    async def _admit(self, req: generate_pb2.GenerateRequest,
                     fill_context: bool) -> tuple[str, asyncio.Queue, int]:
        hb = self.engine.heartbeat
        vocab = hb.vocab_size or self.prompts.tokenizer.vocab_size
        max_len = hb.max_model_len or self.default_max_model_len
        check_sampling(req.sampling, vocab)
        entry = await self.table.resolve_current(req.adapter) if req.adapter else None
        ids = await self.prompts.token_ids(req, entry, max_len, vocab)
        sampling = req.sampling
        if fill_context and not sampling.HasField("max_tokens") and max_len:
            sampling = generate_pb2.SamplingParams()
            sampling.CopyFrom(req.sampling)
            sampling.max_tokens = max_len - len(ids)
        rid, queue = self.engine.open(req.adapter, tuple(entry.replicas) if entry else ())
        try:
            self.engine.submit(rid, ids, req.adapter, sampling)
        except Rejected:
            self.engine.release(rid, abort=False)
            raise
        return rid, queue, len(ids)

    async def Generate(self, request, context):
        sent = None  # the field of a constraint the gateway rewrote, as the caller sent it
        try:
            sent = expand_tag(request.sampling)
            calls = await calls_for(request, self.call_format, self.prompts.tokenizer)
            sent = calls.field if calls is not None and calls.field else sent
            async with contextlib.aclosing(self.stream(request)) as responses:
                async for resp in responses:
                    if calls is not None:
                        calls.add(resp)
                    yield resp
        except Rejected as err:
            err = refused_as(err, sent)
            await rich_status.abort(context, err.code, str(err), field=err.field)

    async def stream(self, request: generate_pb2.GenerateRequest, *, fill_context: bool = False):
        """The responses of one request (what Generate streams, and what the HTTP API
        serves); raises Rejected with the status the call ends with. With fill_context, an
        unset max_tokens means the rest of the model's context (OpenAI's chat default)."""
        # names that do not resolve never take one of the bounded adapter label values
        st = _Stream(request.adapter, "unresolved" if request.adapter else "")
        log = self._log.bind(request_id=request.request_id, adapter=request.adapter or "<base>")
        status, finished, rid = "OK", False, None
        try:
            rid, queue, st.prompt_tokens = await self._admit(request, fill_context)
            st.label = self.metrics.adapter_label(request.adapter)
            log = log.bind(engine_request_id=rid)
            self.metrics.inflight.inc()
            while not finished:
                item = await queue.get()
                if isinstance(item, Rejected):
                    raise item
                finished = item.finished
                yield self._response(request, item, st)
        except Rejected as err:
            status = err.code.name
            raise
        except (asyncio.CancelledError, GeneratorExit):
            status = "CANCELLED"
            raise
        finally:
            if rid is not None:
                replica, attempts = self.engine.placement_of(rid)
                log = log.bind(replica=replica, attempts=attempts)
                self.engine.release(rid, abort=not finished)
                self.metrics.inflight.dec()
            self.metrics.requests.labels(st.label, status).inc()
            log.info("generate", status=status, completion_tokens=st.tokens,
                     ttft_s=None if st.first is None else round(st.first - st.t0, 4),
                     total_s=round(time.monotonic() - st.t0, 4))

    def _response(self, req, d: engine_pb2.RequestDelta, st: _Stream) -> generate_pb2.GenerateResponse:
        now = time.monotonic()
        n = len(d.token_ids)
        if n:
            if st.first is None:
                st.first = now
                self.metrics.ttft.observe(now - st.t0)
                self.metrics.prompt_tokens.labels(st.label).inc(st.prompt_tokens)
            else:
                per_token = (now - st.last) / n
                for _ in range(n):
                    self.metrics.itl.observe(per_token)
            st.last = now
            st.tokens += n
            self.metrics.generated_tokens.labels(st.label).inc(n)
        resp = generate_pb2.GenerateResponse(request_id=req.request_id, token_ids=d.token_ids,
                                             text=d.text, logprobs=d.logprobs)
        if d.finished:
            self.metrics.prefix_cache_queries.inc(d.prompt_tokens or st.prompt_tokens)
            self.metrics.prefix_cache_hits.inc(d.cached_tokens)
            resp.finish_reason = d.finish_reason
            resp.usage.prompt_tokens = d.prompt_tokens or st.prompt_tokens
            resp.usage.completion_tokens = st.tokens
            resp.usage.cached_tokens = d.cached_tokens
            resp.timings.time_to_first_token_s = (st.first or now) - st.t0
            resp.timings.total_s = now - st.t0
        return resp
