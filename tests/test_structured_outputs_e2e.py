"""Constrained outputs obey their constraints, end to end through a real `loramux serve`
and the official openai client: JSON schema (32 concurrent sampled requests over the base
model and two adapters, mixed with free ones), JSON object, regex, choice, grammar; tool
calls under a named or required tool_choice whose arguments validate against the
function's parameters, and the model's own call format parsed under "auto" (held to the
schema by a strict tool); structural tags; a constraint
the grammar library refuses is a 400 naming the field, and the service goes on; schemas
slow to compile stall no other stream.

The schemas are bounded (enums, ranges, short strings, additionalProperties false) so that
even a tiny random model's constrained output ends well within max_tokens."""
from __future__ import annotations

import asyncio
import json
import re
import time

import grpc
import jsonschema
import openai
import pytest
from loramux import GenerateClient, LoramuxError
from loramux.aio import AsyncGenerateClient

# the tiny model, its adapters and `loramux serve`, one per module
from tests.test_openai_tools_serve import client, files, served  # noqa: F401

pytestmark = pytest.mark.timeout(600)
SCHEMA = {"type": "object", "properties": {
    "answer": {"enum": ["yes", "no", "maybe"]},
    "count": {"type": "integer", "minimum": 0, "maximum": 99},
    "ok": {"type": "boolean"},
    "tag": {"type": "string", "minLength": 1, "maxLength": 8, "pattern": "^[a-z]+$"}},
    "required": ["answer", "count", "ok", "tag"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}},
    "required": ["tz"], "additionalProperties": False}}}
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "answer in JSON"}]
REGEX = r"(yes|no)-[0-9]{1,3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'start: ("ab" | "cd") ("ab" | "cd") "!"'


@pytest.fixture(scope="module")
def models(files):
    return [files["model"], "a1", "a2"]


def test_json_schema_under_concurrent_sampled_load(served, models):
    schema_format = {"type": "json_schema",
                     "json_schema": {"name": "reply", "schema": SCHEMA, "strict": True}}

    async def one(aclient, i):
        kw = dict(model=models[i % 3], max_tokens=120, temperature=1.0, seed=i)
        if i % 4 == 3:  # free requests share the batches
            out = await aclient.chat.completions.create(messages=ASK, **kw)
            return None, out.choices[0]
        if i % 2:
            out = await aclient.completions.create(  # the client's completions lack the field
                prompt="json: ", extra_body={"response_format": schema_format}, **kw)
            return "text", out.choices[0]
        out = await aclient.chat.completions.create(messages=ASK, response_format=schema_format,
                                                    **kw)
        return "chat", out.choices[0]

    async def main():
        async with openai.AsyncOpenAI(base_url=served.http + "/v1", api_key="none",
                                      max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))

    for kind, choice in asyncio.run(main()):
        if kind is None:
            assert isinstance(choice.message.content, str)
            continue
        text = choice.text if kind == "text" else choice.message.content
        assert choice.finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def _both(client, model, **kw) -> list[str]:
    """The output of a chat request, not streamed and streamed (with its finish reason)."""
    out = client.chat.completions.create(model=model, messages=ASK, **kw)
    chunks = [c.choices[0] for c in client.chat.completions.create(
        model=model, messages=ASK, stream=True, **kw) if c.choices]
    assert out.choices[0].finish_reason == chunks[-1].finish_reason == "stop"
    return [out.choices[0].message.content, "".join(c.delta.content or "" for c in chunks)]


def test_regex_choice_and_grammar_hold(client, models):
    for seed, model in enumerate(models):
        kw = dict(max_tokens=40, temperature=1.0, seed=seed)
        for text in _both(client, model, extra_body={"structured_outputs": {"regex": REGEX}}, **kw):
            assert re.fullmatch(REGEX, text), text
        for text in _both(client, model, extra_body={"guided_choice": CHOICES}, **kw):
            assert text in CHOICES
        for text in _both(client, model, extra_body={"structured_outputs": {"grammar": GRAMMAR}},
                          **kw):
            assert re.fullmatch(r"(ab|cd){2}!", text), text
        comp = client.completions.create(model=model, prompt="pick: ", max_tokens=40,
                                         extra_body={"guided_regex": REGEX}, seed=seed)
        assert re.fullmatch(REGEX, comp.choices[0].text)


def test_json_object_outputs_are_objects(client, models):
    """Any object: its length is up to the model, so outputs cut at max_tokens are not
    judged, and at least some must end on their own."""
    ended = 0
    for seed in range(6):
        out = client.chat.completions.create(model=models[seed % 3], messages=ASK,
                                             response_format={"type": "json_object"},
                                             max_tokens=300, temperature=1.0, seed=seed)
        if out.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(out.choices[0].message.content), dict)
            ended += 1
    assert ended


def _calls_of(client, model, stream: bool, **kw) -> tuple[list[tuple[str, str]], str]:
    """[(name, arguments)] and the finish reason of a chat with tools."""
    kw = {"model": model, "messages": ASK, "tools": [WEATHER, TIME], "max_tokens": 150,
          "temperature": 1.0, **kw}
    if not stream:
        choice = client.chat.completions.create(**kw).choices[0]
        return [(c.function.name, c.function.arguments)
                for c in choice.message.tool_calls or ()], choice.finish_reason
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kw):
        for d in chunk.choices[0].delta.tool_calls or ():
            have = calls.setdefault(d.index, ["", ""])
            have[0] += d.function.name or ""
            have[1] += d.function.arguments or ""
        reason = chunk.choices[0].finish_reason or reason
    return [tuple(v) for _, v in sorted(calls.items())], reason


@pytest.mark.parametrize("stream", [False, True])
def test_named_and_required_tool_calls_validate(client, models, stream):
    named = {"type": "function", "function": {"name": "time"}}
    for seed, model in enumerate(models):
        calls, reason = _calls_of(client, model, stream, tool_choice=named, seed=seed)
        assert reason == "tool_calls" and [n for n, _ in calls] == ["time"]
        jsonschema.validate(json.loads(calls[0][1]), PARAMS["time"])
        calls, reason = _calls_of(client, model, stream, tool_choice="required",
                                  parallel_tool_calls=False, seed=seed)
        assert reason == "tool_calls" and len(calls) == 1
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMS[name])


def test_auto_parses_the_models_own_format(client):
    """A call in the template's (hermes) format, forced by a regex, comes back parsed."""
    written = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    for stream in (False, True):
        calls, reason = _calls_of(client, "a2", stream, extra_body={
            "structured_outputs": {"regex": re.escape(written)}})
        assert reason == "tool_calls"
        assert [(n, json.loads(a)) for n, a in calls] == [("weather", {"city": "Oslo", "days": 2})]


def _strict(tool: dict, parameters: dict | None = None) -> dict:
    function = {**tool["function"], "strict": True}
    return {"type": "function", "function": {**function, "parameters": parameters}
            if parameters is not None else function}


def test_strict_tools_hold_the_calls_auto_writes(client, models):
    """A strict tool under "auto": the engine compiles the grammar of the calls (one it
    refuses is a 400 naming `tools`, where the same tools not strict serve), and sampled
    outputs, streamed or not, carry only calls that validate and no marker as text."""
    refused = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    loose = {"type": "function", "function": {**TIME["function"], "parameters": refused}}
    with pytest.raises(openai.BadRequestError) as info:
        _calls_of(client, "a1", False, tools=[WEATHER, _strict(TIME, refused)], seed=0)
    assert info.value.body["param"] == "tools" and "tools" in info.value.body["message"]
    assert _calls_of(client, "a1", False, tools=[WEATHER, loose], seed=0)[1]
    for seed, model in enumerate(models * 2):
        tools = [_strict(WEATHER), TIME]
        calls, reason = _calls_of(client, model, seed % 2 == 1, tools=tools, seed=seed)
        assert reason in ("stop", "length", "tool_calls"), reason
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), PARAMS[name])
        out = client.chat.completions.create(model=model, messages=ASK, tools=tools,
                                             max_tokens=150, temperature=1.0, seed=seed)
        assert "<tool_call>" not in (out.choices[0].message.content or "")


def test_structural_tags_hold_each_trigger(client, models):
    """vLLM's structural tag: wherever the model writes the trigger (a letter it writes
    often) the structure follows, and the text around it is free."""
    tag = {"triggers": ["e"], "structures": [{"begin": "e", "schema": {"enum": ["X"]},
                                              "end": "."}]}
    held = loose = 0
    for seed, model in enumerate(models):
        kw = dict(model=model, max_tokens=80, temperature=1.0, seed=seed)
        free = client.chat.completions.create(messages=ASK, **kw).choices[0].message.content
        loose += re.sub(r'e"X"\.', "", free).count("e")
        for out in (client.chat.completions.create(
                        messages=ASK, response_format={"type": "structural_tag", **tag},
                        **kw).choices[0].message.content,
                    client.completions.create(prompt="hello", extra_body={
                        "structured_outputs": {"structural_tag": json.dumps(tag)}},
                        **kw).choices[0].text):
            assert "e" not in re.sub(r'e"X"\.', "", out), out
            held += out.count('e"X".')
    assert held and loose  # the tag held where free text has the letter alone


def test_grpc_structural_tags(served):
    """The SDK's structural_tag: held as over HTTP; a malformed one, or one whose schema
    the library refuses, is INVALID_ARGUMENT naming the field sent."""
    tag = {"triggers": ["e"], "structures": [{"begin": "e", "schema": {"enum": ["X"]},
                                              "end": "."}]}
    with GenerateClient(served.gateway) as g:
        held = 0
        for seed in range(3):
            out = g.generate("hello", "a1", max_tokens=80, temperature=1.0, seed=seed,
                             structural_tag=tag).text
            assert "e" not in re.sub(r'e"X"\.', "", out), out
            held += out.count('e"X".')
        assert held
        missing = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
        for bad, field in (({**tag, "triggers": []}, "triggers"),
                           ({**tag, "structures": [{"begin": "f", "end": ""}]},
                            "structures[0].begin"),
                           ({**tag, "structures": [{"begin": "e", "schema": missing,
                                                    "end": ""}]}, "")):
            with pytest.raises(LoramuxError) as info:
                g.generate("hello", "a1", max_tokens=4, structural_tag=bad)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            want = "sampling.structured.structural_tag" + ("." + field if field else "")
            assert [f for f, _ in info.value.field_violations] == [want], info.value


def test_constraints_the_library_refuses_are_400_naming_them(client, served):
    refused = [({"response_format": {"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "object", "properties": {
                        "a": {"$ref": "#/$defs/missing"}}}}}},
                "response_format.json_schema.schema"),
               ({"extra_body": {"structured_outputs": {"grammar": "start: ("}}},
                "structured_outputs.grammar"),
               ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex")]
    for fields, param in refused:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as info:
                client.chat.completions.create(model="a1", messages=ASK, max_tokens=8,
                                               stream=stream, **fields)
            assert info.value.body["param"] == param
            assert info.value.body["message"].startswith(param)
    with GenerateClient(served.gateway) as g:
        with pytest.raises(LoramuxError) as info:
            g.generate("x", "a1", max_tokens=8, grammar="start: (")
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert [f for f, _ in info.value.field_violations] == ["sampling.structured.grammar"]
        out = g.generate("x", "a1", max_tokens=40, choice=CHOICES, temperature=1.0, seed=3)
        assert out.text in CHOICES  # the SDK's constraint, after the refusals
    out = client.chat.completions.create(model="a1", messages=ASK, max_tokens=8)
    assert out.usage.completion_tokens == 8


def test_free_greedy_requests_are_the_same_beside_constrained_ones(served, models):
    """The masks touch only their own rows: free greedy completions come out token for
    token the same alone and in batches shared with constrained requests."""
    schema_format = {"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}}
    free = [dict(model=models[i % 3], prompt=f"story {i}:", max_tokens=24, temperature=0.0,
                 logprobs=0) for i in range(6)]

    def tokens(choice):
        return choice.logprobs.tokens

    async def run(with_constrained: bool):
        async with openai.AsyncOpenAI(base_url=served.http + "/v1", api_key="none",
                                      max_retries=0) as aclient:
            calls = [aclient.completions.create(**kw) for kw in free]
            if with_constrained:
                calls += [aclient.completions.create(
                    model=models[i % 3], prompt="json: ", max_tokens=120, temperature=1.0,
                    seed=i, extra_body={"response_format": schema_format}) for i in range(10)]
            outs = await asyncio.gather(*calls)
        return [tokens(o.choices[0]) for o in outs[:len(free)]]

    alone = asyncio.run(run(False))
    assert alone == asyncio.run(run(True))


def _wide_schema(tag: str, n: int = 2200) -> dict:
    """n required integers, each in a range of its own with 16-19 digit bounds: about a
    second for the library to compile on a two-core CPU (within the 256 kB a schema may
    have and the library's limits); another tag is another compile."""
    lo, hi = 1234567890123457, 8876543210987654321
    props = {f"{tag}{i}": {"type": "integer", "minimum": lo + i * 7919,
                           "maximum": hi - i * 104729} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_slow_compiles_stall_no_other_stream(served, models):
    """Two schemas slow to compile take both compile threads and a regex waits behind
    them, while free streams decode: those never pause for a compile (no gap between two
    of their steps near a compile's length), they make progress while the compiles run,
    and the constrained requests are served once compiled. The free streams are watched
    over gRPC, one response per engine step (text would come in bursts: a character of
    several tokens is sent once whole)."""
    gap_bound = 0.6   # a stall is a whole compile, about a second; a step here ~10 ms
    slow = [{"response_format": {"type": "json_schema", "json_schema": {
                 "name": tag, "schema": _wide_schema(tag)}}} for tag in ("p", "q")]
    waiting = r"(xy|z){2,4}-[0-9]"   # not compiled before: it waits for a thread
    slow.append({"structured_outputs": {"regex": waiting}})

    async def free(grpc_client, i, started: asyncio.Event, times: list[float]) -> int:
        tokens = 0
        try:
            async for resp in grpc_client.stream(f"story {i}:", [None, "a1", "a2"][i % 3],
                                                 max_tokens=400, temperature=0.0,
                                                 ignore_eos=True):
                if resp.token_ids:
                    times.append(time.monotonic())
                    tokens += len(resp.token_ids)
                    started.set()
        finally:
            started.set()  # a stream that failed fails the test below, not hangs it
        return tokens

    async def constrained(aclient, fields):
        stream = await aclient.completions.create(
            model="a1", prompt="json: ", max_tokens=40, temperature=1.0, seed=5, stream=True,
            extra_body=fields)
        text, first = "", None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first = first or time.monotonic()
                text += chunk.choices[0].text
        return text, first

    async def main():
        async with openai.AsyncOpenAI(base_url=served.http + "/v1", api_key="none",
                                      max_retries=0, timeout=120) as aclient, \
                AsyncGenerateClient(served.gateway) as grpc_client:
            starts = [asyncio.Event() for _ in range(4)]
            times: list[list[float]] = [[] for _ in starts]
            frees = [asyncio.create_task(free(grpc_client, i, s, t))
                     for i, (s, t) in enumerate(zip(starts, times))]
            await asyncio.gather(*(s.wait() for s in starts))
            sent = time.monotonic()
            outs = await asyncio.gather(*(constrained(aclient, f) for f in slow))
            return await asyncio.gather(*frees), times, sent, outs

    tokens, times, sent, outs = asyncio.run(main())
    assert tokens == [400] * 4
    compiled = max(first for _, first in outs)
    for (text, _), tag in zip(outs, "pq"):  # cut at max_tokens: its first value holds
        first_value = re.match(rf'\{{"{tag}0": (\d+)[,}}]', text)
        assert first_value and 1234567890123457 <= int(first_value[1]) <= 8876543210987654321
    assert re.fullmatch(waiting, outs[2][0]), outs[2][0]
    for stream_times in times:
        during = [t for t in stream_times if sent <= t <= compiled]
        assert len(during) >= 5, (len(during), compiled - sent)  # it ran through the compiles
        edges = [t for t in stream_times if t < sent][-1:] + during
        assert max(b - a for a, b in zip(edges, edges[1:])) < gap_bound
