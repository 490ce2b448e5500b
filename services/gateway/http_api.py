"""The OpenAI-compatible HTTP API of the gateway: /v1/models, /v1/completions,
/v1/chat/completions (and /health), served in the gateway's process and event loop.

Every choice of a request is one run of GenerateServicer.stream, the same path gRPC calls
take (validation, chat template, tokenization off the loop, adapter resolution, admission,
metrics), so the two APIs cannot drift apart. `model` is the served base model's name or
a loaded adapter's name. Errors have OpenAI's shape; gRPC status codes map onto HTTP ones."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import time

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from loramux_services.gateway.chat_tools import strict_constraint
from loramux_services.gateway.errors import BadParam, Rejected
from loramux_services.gateway.openai_responses import Choice, Shape, usage
from loramux_services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from loramux_services.gateway.structured import renamed

_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "invalid_request_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable_error"}
RETRY_AFTER_S = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    @classmethod
    def from_rejected(cls, err: Rejected, constraint_param: str | None = None) -> "ApiError":
        """With `constraint_param`, a refused output constraint (sampling.structured.*, by
        the gateway or the engine's compiler) is told about the field the user sent."""
        status = _HTTP_STATUS.get(err.code, 500)
        if constraint_param and (err.field or "").startswith("sampling.structured"):
            return cls(status, renamed(str(err), err.field, constraint_param),
                       param=constraint_param, code=err.code.name.lower())
        return cls(status, str(err), param=_param(err.field), code=err.code.name.lower())


def _param(field: str | None) -> str | None:
    """The OpenAI parameter for a field of the gRPC request (Rejected.field)."""
    if not field:
        return None
    if field in ("text", "token_ids.ids"):
        return "prompt"
    return field.removeprefix("sampling.").replace("messages.messages", "messages")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "internal_error"),
                      "param": param, "code": code}}


def error_response(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if err.status in (429, 503) else None
    return JSONResponse(error_body(err.status, str(err), err.param, err.code),
                        status_code=err.status, headers=headers)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIFront:
    """What the routes need from the gateway: its servicer, adapter table and tokenizer."""

    def __init__(self, servicer, table, *, model_name: str, model_root: str):
        self.servicer, self.table = servicer, table
        self.model_name, self.model_root = model_name, model_root
        self.created = int(time.time())

    @property
    def tokenizer(self):
        return self.servicer.prompts.tokenizer

    async def adapter_for(self, model: str) -> str:
        """The adapter a `model` value names ("" for the base model), or 404."""
        if model in (self.model_name, self.model_root):  # the path: what was served before
            return ""
        try:
            await self.table.resolve_current(model)
        except Rejected as err:
            if err.code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION):
                raise ApiError(404, f"The model `{model}` does not exist or is not loaded "
                               f"({err})", param="model", code="model_not_found") from None
            raise ApiError.from_rejected(err) from None
        return model

    async def _tool_plan(self, body, adapter: str):
        """The request's tool plan with, under "auto", the call format to parse."""
        plan = getattr(body, "plan", None)
        if plan is None or plan.mode != "auto":
            return plan
        return dataclasses.replace(plan, fmt=await self.servicer.call_format(adapter))

    def _hold_calls(self, body, plan, requests) -> str | None:
        """The field the output's constraint came from. With nothing else constraining
        it, a strict tool under "auto" holds the calls to the tools (strict_constraint)."""
        by_calls = None if body.constraint_param is not None else \
            strict_constraint(plan, getattr(body, "tools", None), self.tokenizer)
        if by_calls is None:
            return body.constraint_param
        for r in requests:
            r.sampling.structured.CopyFrom(by_calls.structured)
        return by_calls.param

    def models(self) -> dict:
        max_len = self.servicer.engine.heartbeat.max_model_len or \
            self.servicer.default_max_model_len
        base = {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "loramux", "root": self.model_root, "parent": None,
                "max_model_len": max_len}
        adapters = [{"id": e.name, "object": "model", "created": self.created,
                     "owned_by": "loramux", "root": e.path, "parent": self.model_name}
                    for e in self.table.loaded()]
        return {"object": "list", "data": [base, *adapters]}

    async def _open(self, req, fill_context: bool):
        """Start one choice: (its first response, the rest); Rejected before any output."""
        responses = self.servicer.stream(req, fill_context=fill_context)
        try:
            first = await anext(responses)
        except BaseException:
            await responses.aclose()
            raise
        return first, responses

    async def run(self, body, *, chat: bool, http_request: Request):
        adapter = await self.adapter_for(body.model)
        try:
            requests = body.generate_requests(adapter)
            plan = await self._tool_plan(body, adapter)
            param = self._hold_calls(body, plan, requests)
        except BadParam as err:
            raise ApiError(400, str(err), param=err.param) from None
        shape = Shape(chat, body.model, self.tokenizer, return_token_ids=body.return_token_ids,
                      tools=plan)
        per_prompt = body.n
        firsts = set(range(0, len(requests), per_prompt))
        opened = await asyncio.gather(*(self._open(r, chat) for r in requests),
                                      return_exceptions=True)
        failed = next((x for x in opened if isinstance(x, BaseException)), None)
        if failed is not None:
            for x in opened:
                if not isinstance(x, BaseException):
                    await x[1].aclose()
            if isinstance(failed, Rejected):
                raise ApiError.from_rejected(failed, param)
            raise failed
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._events(shape, opened, firsts, include_usage, param),
                                     media_type="text/event-stream")
        work = asyncio.ensure_future(self._collect(shape, opened, param))
        watch = asyncio.ensure_future(_until_disconnected(http_request))
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():  # the client is gone: the engine stops its requests
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            return Response(status_code=499)
        choices = work.result()
        return JSONResponse(shape.response(choices, usage(choices, firsts)))

    async def _collect(self, shape: Shape, opened, param: str | None) -> list[Choice]:
        """Every choice to its end; the first failure stops the others."""
        async def drain(i, first, responses):
            choice = shape.choice(i)
            choice.add(first)
            async with contextlib.aclosing(responses):
                async for resp in responses:
                    choice.add(resp)
            return choice

        tasks = [asyncio.ensure_future(drain(i, f, r)) for i, (f, r) in enumerate(opened)]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        try:
            return [t.result() for t in tasks]
        except Rejected as err:
            raise ApiError.from_rejected(err, param) from None

    async def _events(self, shape: Shape, opened, firsts: set[int], include_usage: bool,
                      param: str | None):
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, first, responses):
            try:
                async with contextlib.aclosing(responses):
                    await queue.put((i, first))
                    async for resp in responses:
                        await queue.put((i, resp))
            except Rejected as err:
                await queue.put((i, err))
            finally:
                await queue.put((i, None))

        tasks = [asyncio.ensure_future(pump(i, f, r)) for i, (f, r) in enumerate(opened)]
        choices = [shape.choice(i) for i in range(len(opened))]
        try:
            if shape.chat:
                for c in choices:
                    yield _sse(shape.chunk(c.index, None))
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Rejected):
                    err = ApiError.from_rejected(item, param)
                    yield _sse(error_body(err.status, str(err), err.param, err.code))
                    break
                else:
                    choices[i].add(item)
                    for chunk in shape.chunks(choices[i], item):
                        yield _sse(chunk)
            else:
                if include_usage:
                    yield _sse(shape.usage_chunk(usage(choices, firsts)))
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def _until_disconnected(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.25)


def build_app(front: OpenAIFront) -> FastAPI:
    app = FastAPI(title="loramux", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request, err: ApiError):
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else \
            first.get("msg", "invalid request body")
        return error_response(ApiError(400, message, param=param))

    @app.exception_handler(HTTPException)
    async def _http(_request, err: HTTPException):
        return error_response(ApiError(err.status_code, str(err.detail)))

    @app.get("/health")
    async def health():
        up = front.servicer.engine.up and not front.servicer.engine.draining
        return JSONResponse({"status": "ok" if up else "engine unavailable"},
                            status_code=200 if up else 503)

    @app.get("/v1/models")
    async def models():
        return front.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        for m in front.models()["data"]:
            if m["id"] == model_id:
                return m
        raise ApiError(404, f"The model `{model_id}` does not exist.", param="model",
                       code="model_not_found")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await front.run(body, chat=False, http_request=request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await front.run(body, chat=True, http_request=request)

    return app
