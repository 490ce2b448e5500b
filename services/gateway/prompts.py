"""Prompts to token ids, off the event loop: text, token ids, or chat messages rendered by
the chat template of the adapter (when its directory has one) or of the base model.
An adapter's files are read inside the adapter roots, without following links, like the
control plane and the engine read them (loramux_core/safe_files.py).

Tokenizing a prompt of megabytes takes seconds; done on the event loop it would stall every
other stream, so it runs in a small thread pool (the tokenizer releases the GIL while it
works). A request's size is capped before it gets here (the gRPC message limit, the HTTP
body limit)."""
from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor

import grpc
from loramux.v1 import generate_pb2

from loramux_core.v1 import engine_pb2
from loramux_services.common.chat_template import (MAX_TEMPLATE_BYTES, ChatTemplate,
                                                   ChatTemplateError, special_tokens_of,
                                                   text_of)
from loramux_services.gateway.errors import Rejected
from loramux_services.gateway.validation import check_prompt_ids, encode_text

MAX_CHAT_MESSAGES = 4096
# A token covers at most as many characters of text as its vocabulary entry has (byte-level
# BPE: one character per byte; SentencePiece: one per character); normalizers that merge
# characters (NFC) shrink text by less than this factor.
SHRINK = 4


def _bad(message: str, field: str) -> Rejected:
    return Rejected(grpc.StatusCode.INVALID_ARGUMENT, message, field)


class PromptBuilder:
    def __init__(self, tokenizer, model_dir: str, *, workers: int | None = None,
                 adapter_roots=None):
        """`adapter_roots`: an loramux_core.safe_files.AdapterRoots; None: an adapter's
        directory is trusted as named by the control plane (its files are still never
        read through a link)."""
        self.tokenizer = tokenizer
        self._roots = adapter_roots
        self._special = special_tokens_of(model_dir)
        self.base_template = ChatTemplate.from_dir(model_dir, self._special)
        # adapter name -> (adapter id, path, its own template or None)
        self._adapter_templates: dict[str, tuple[int, str, ChatTemplate | None]] = {}
        self._pool = ThreadPoolExecutor(workers or min(4, os.cpu_count() or 1),
                                        thread_name_prefix="tokenize")
        self._max_token_chars = max(
            (len(t) for t in map(tokenizer.id_to_token, range(tokenizer.vocab_size)) if t),
            default=1)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def token_ids(self, req: generate_pb2.GenerateRequest,
                        adapter: engine_pb2.AdapterTableEntry | None, max_model_len: int,
                        vocab_size: int) -> list[int]:
        """The prompt's ids; Rejected(INVALID_ARGUMENT) when it is empty, malformed, has ids
        outside the vocabulary or leaves no room for one generated token."""
        self._check_size(req, max_model_len)
        loop = asyncio.get_running_loop()
        ids = await loop.run_in_executor(self._pool, self._encode, req, adapter, vocab_size)
        check_prompt_ids(ids, max_model_len)
        return ids

    def _check_size(self, req: generate_pb2.GenerateRequest, max_model_len: int) -> None:
        """Refuse, without tokenizing, a prompt too long for the model whatever its tokens:
        one of n characters has at least n / (SHRINK * longest vocabulary entry) tokens."""
        which = req.WhichOneof("prompt")
        if which == "token_ids":
            n, field = len(req.token_ids.ids), "token_ids.ids"
        elif which == "text":
            n, field = len(req.text) // (SHRINK * self._max_token_chars), "text"
        elif which == "messages":
            chars = len(req.messages.tools) + sum(
                len(m.content) + sum(len(c.arguments) for c in m.tool_calls)
                for m in req.messages.messages)
            n, field = chars // (SHRINK * self._max_token_chars), "messages.messages"
        else:
            return
        if max_model_len and n >= max_model_len:
            raise _bad(f"the prompt has at least {n} tokens; the model's limit is "
                       f"{max_model_len} tokens for prompt and output together", field)

    def _encode(self, req, adapter, vocab_size: int) -> list[int]:
        which = req.WhichOneof("prompt")
        if which == "text":
            if not req.text:
                raise _bad("prompt text is empty", "text")
            return encode_text(self.tokenizer, req.text)
        if which == "token_ids":
            ids = list(req.token_ids.ids)
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise _bad(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})",
                           "token_ids.ids")
            return ids
        if which == "messages":
            text = self.render_chat(req.messages, adapter)
            return self.tokenizer.encode(text, add_special_tokens=False)
        raise _bad("the request has no prompt (set text, token_ids or messages)", "prompt")

    def render_chat(self, chat: generate_pb2.ChatMessages,
                    adapter: engine_pb2.AdapterTableEntry | None) -> str:
        """The chat's prompt text under the adapter's template, else the base model's."""
        if not chat.messages:
            raise _bad("messages is empty", "messages.messages")
        if len(chat.messages) > MAX_CHAT_MESSAGES:
            raise _bad(f"messages has {len(chat.messages)} entries; at most {MAX_CHAT_MESSAGES}",
                       "messages.messages")
        for i, m in enumerate(chat.messages):
            if not m.role:
                raise _bad(f"messages[{i}].role is empty", f"messages.messages[{i}].role")
        template = self._template(adapter)
        add = chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True
        try:
            return template.render(template_messages(chat),
                                   add_generation_prompt=add and not chat.continue_final_message,
                                   continue_final_message=chat.continue_final_message,
                                   tools=template_tools(chat))
        except ChatTemplateError as err:
            raise _bad(str(err), "messages") from None

    async def template_source(self, adapter: engine_pb2.AdapterTableEntry | None) -> str | None:
        """The text of the chat template a request for `adapter` renders with (None: none);
        read off the event loop, as an adapter's template is read from its directory."""
        loop = asyncio.get_running_loop()
        try:
            template = await loop.run_in_executor(self._pool, self._template, adapter)
        except Rejected:
            return None
        return template.source

    def _template(self, adapter: engine_pb2.AdapterTableEntry | None) -> ChatTemplate:
        own = self._adapter_template(adapter) if adapter is not None else None
        template = own or self.base_template
        if template is None:
            raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                           "the model has no chat template (no chat_template.jinja and no "
                           "chat_template in tokenizer_config.json); send a text prompt")
        return template

    def _read_template(self, path: str) -> ChatTemplate | None:
        if self._roots is None:
            return ChatTemplate.from_dir(path, self._special)
        from loramux_core.errors import AdapterError
        try:
            with self._roots.open_dir(path) as d:
                def read(name: str) -> str | None:
                    if d.kind(name) is None:
                        return None
                    return text_of(d.read(name, MAX_TEMPLATE_BYTES + 1).data, name)
                return ChatTemplate.from_files(read, self._special)
        except AdapterError as err:
            raise ChatTemplateError(str(err)) from None

    def _adapter_template(self, entry: engine_pb2.AdapterTableEntry) -> ChatTemplate | None:
        cached = self._adapter_templates.get(entry.name)
        if cached is not None and cached[:2] == (entry.id, entry.path):
            return cached[2]
        template = None
        if entry.path:
            try:
                template = self._read_template(entry.path)
            except ChatTemplateError as err:
                raise Rejected(grpc.StatusCode.FAILED_PRECONDITION,
                               f"adapter {entry.name!r} has an unusable chat template: {err}") from None
            except OSError:
                template = None  # the directory is not visible here: the base template serves
        self._adapter_templates[entry.name] = (entry.id, entry.path, template)
        return template


def template_messages(chat: generate_pb2.ChatMessages) -> list[dict]:
    """The messages as transformers passes them to a template: a turn of tool calls has
    content None (unless it has text) and its calls' arguments parsed (templates write them
    with `tojson`); a tool result carries the id of its call."""
    out = []
    for m in chat.messages:
        msg = {"role": m.role, "content": m.content if m.HasField("content") else None}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.name, "arguments": _parsed(c.arguments)}} for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def _parsed(arguments: str):
    try:
        return json.loads(arguments)
    except (ValueError, RecursionError):
        return arguments  # as written: the template shows what the model was given


def template_tools(chat: generate_pb2.ChatMessages) -> list | None:
    """The tools for the template (None without any), as the HTTP API checked them; JSON
    from a gRPC caller that is not a list is refused naming the field."""
    if not chat.tools:
        return None
    try:
        tools = json.loads(chat.tools)
    except (ValueError, RecursionError) as err:
        raise _bad(f"messages.tools: not JSON: {str(err)[:200]}", "messages.tools") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise _bad("messages.tools: a JSON list of tool objects is required", "messages.tools")
    return tools
