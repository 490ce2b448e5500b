"""OpenAI response bodies and stream chunks, built from the gateway's GenerateResponses.

`Shape` holds what differs between /v1/completions and /v1/chat/completions (object names,
where text goes, the logprobs layout, tool calls); `Choice` accumulates one choice's
responses."""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from loramux.v1 import generate_pb2

from loramux_services.gateway.chat_tools import ToolPlan
from loramux_services.gateway.tool_output import ChoiceTools

_FINISH = {generate_pb2.FINISH_REASON_LENGTH: "length", generate_pb2.FINISH_REASON_STOP: "stop",
           generate_pb2.FINISH_REASON_EOS: "stop", generate_pb2.FINISH_REASON_ABORTED: "abort",
           generate_pb2.FINISH_REASON_ERROR: "error"}


def finish_reason(resp: generate_pb2.GenerateResponse) -> str | None:
    return _FINISH.get(resp.finish_reason) if resp.finish_reason else None


@dataclass
class Choice:
    """One choice's output so far."""
    index: int
    # the text, piece by piece: `text += piece` would copy all of it per response
    pieces: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    usage: generate_pb2.Usage | None = None
    tools: ChoiceTools | None = None  # a chat choice whose output may hold tool calls

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, resp: generate_pb2.GenerateResponse) -> None:
        if resp.text:
            self.pieces.append(resp.text)
        self.token_ids.extend(resp.token_ids)
        self.logprobs.extend(resp.logprobs)
        if resp.finish_reason:
            self.finish_reason = finish_reason(resp)
            self.usage = resp.usage


def usage(choices: list[Choice], prompts_seen: set[int] | None = None) -> dict:
    """OpenAI usage over choices. Choices of the same prompt count its tokens once (n > 1
    shares one prompt); `prompts_seen` holds the index of one choice per distinct prompt."""
    done = [c for c in choices if c.usage is not None]
    firsts = done if prompts_seen is None else [c for c in done if c.index in prompts_seen]
    prompt = sum(c.usage.prompt_tokens for c in firsts)
    completion = sum(c.usage.completion_tokens for c in done)
    cached = sum(c.usage.cached_tokens for c in firsts)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion, "prompt_tokens_details": {"cached_tokens": cached}}


class Shape:
    """Completions or chat completions: ids, object names and field layout."""

    def __init__(self, chat: bool, model: str, tokenizer, *, return_token_ids: bool = False,
                 tools: ToolPlan | None = None):
        self.chat, self.model, self.tokenizer = chat, model, tokenizer
        self.return_token_ids = return_token_ids
        self.tools = tools
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def choice(self, index: int) -> Choice:
        tools = ChoiceTools(self.tools) if self.tools is not None else None
        return Choice(index, tools=tools if tools is not None and tools.parses else None)

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _logprobs(self, ids, lps: list[generate_pb2.TokenLogprob]) -> dict | None:
        if not lps:
            return None
        if self.chat:
            return {"content": [
                {**self._chat_entry(t, lp.logprob),
                 "top_logprobs": [self._chat_entry(x.token_id, x.logprob) for x in lp.top]}
                for t, lp in zip(ids, lps)]}
        tokens = [self._token(t) for t in ids]
        offsets = [0]
        for t in tokens[:-1]:
            offsets.append(offsets[-1] + len(t))
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{self._token(x.token_id): x.logprob for x in lp.top} for lp in lps],
                "text_offset": offsets}

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self._token(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def response(self, choices: list[Choice], usage_dict: dict) -> dict:
        """The whole (non-streamed) response."""
        out = []
        for c in choices:
            item = {"index": c.index, "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason}
            if self.chat:
                item["message"] = self._message(c)
                if "tool_calls" in item["message"]:
                    item["finish_reason"] = _with_calls(c.finish_reason)
            else:
                item["text"] = c.text
            if self.return_token_ids:
                item["token_ids"] = c.token_ids
            out.append(item)
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": out, "usage": usage_dict}

    @staticmethod
    def _message(c: Choice) -> dict:
        if c.tools is None:
            return {"role": "assistant", "content": c.text}
        content, calls = c.tools.whole(c.text)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [call.openai() for call in calls]
        return message

    def chunk(self, index: int, resp: generate_pb2.GenerateResponse | None) -> dict:
        """One stream chunk for choice `index` (the chat role chunk when resp is None)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        item: dict = {"index": index, "logprobs": None, "finish_reason": None}
        if resp is not None:
            item["logprobs"] = self._logprobs(resp.token_ids, list(resp.logprobs))
            item["finish_reason"] = finish_reason(resp)
            if self.return_token_ids:
                item["token_ids"] = list(resp.token_ids)
        if self.chat:
            delta = {"role": "assistant", "content": ""} if resp is None else {}
            if resp is not None and (resp.text or not resp.finish_reason):
                delta["content"] = resp.text
            item["delta"] = delta
        else:
            item["text"] = resp.text if resp is not None else ""
        return {**self._head(obj), "choices": [item], "usage": None}

    def chunks(self, c: Choice, resp: generate_pb2.GenerateResponse) -> list[dict]:
        """The stream chunks of one response of choice `c`: one, or for a choice that may
        call tools, one per delta its text makes (the response's token ids and logprobs
        on the first, its finish reason on the last)."""
        first = self.chunk(c.index, resp)
        if c.tools is None:
            return [first]
        deltas = c.tools.feed(resp.text) + (c.tools.finish() if resp.finish_reason else [])
        out = []
        for k, delta in enumerate(deltas or [{}]):
            chunk = first if k == 0 else self.chunk(c.index, None)
            item = chunk["choices"][0]
            item["delta"], item["finish_reason"] = delta, None
            if k:
                item["logprobs"] = None
                item.pop("token_ids", None)
            out.append(chunk)
        if resp.finish_reason:
            reason = finish_reason(resp)
            out[-1]["choices"][0]["finish_reason"] = _with_calls(reason) if c.tools.sent else reason
        return out

    def usage_chunk(self, usage_dict: dict) -> dict:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage_dict}


def _with_calls(reason: str | None) -> str | None:
    """A choice that called tools and stopped on its own finished with "tool_calls"."""
    return "tool_calls" if reason == "stop" else reason
