"""Structured outputs and tools through a real `loramux serve`, the parts that hold
whatever the engine does with the constraint: malformed constraints refused naming the
field the user sent (HTTP, gRPC, CLI) with the service undisturbed, tools and tool-call
history rendered by the chat template, tool_choice "auto" and a named function giving
well-formed responses, streamed and not. What the constrained outputs themselves obey is
tests/test_structured_outputs_e2e.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import grpc
import openai
import pytest
from loramux import GenerateClient, LoramuxError

from loramux_core.tokenizer import Tokenizer
from loramux_services.common.chat_template import ChatTemplate
from tests.support.openai_serve import make_files, serving
from tests.support.serve_process import ENV, ROOT

pytestmark = pytest.mark.timeout(300)
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "today's weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "weather in Paris?"}]
HISTORY = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
    {"id": "chatcmpl-tool-1", "type": "function",
     "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
    {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "sunny, 21 C"}]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return make_files(tmp_path_factory.mktemp("tools"))


@pytest.fixture(scope="module")
def served(files):
    with serving(files) as serve:
        yield serve


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.http + "/v1", api_key="none", max_retries=0)


def _chat(client, **kw):
    return client.chat.completions.create(model="a1", messages=ASK, max_tokens=8, **kw)


BAD = [  # (endpoint, request fields, the param the 400 names)
    ("chat", {"response_format": {"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": "{nope"}}},
     "response_format.json_schema.schema"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format.type"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
     "structured_outputs"),
    ("chat", {"extra_body": {"structured_outputs": {"choice": []}}}, "structured_outputs.choice"),
    ("chat", {"extra_body": {"structured_outputs": {"regex": ""}}}, "structured_outputs.regex"),
    ("completions", {"extra_body": {"guided_grammar": "g" * (256 * 1024 + 1)}}, "guided_grammar"),
    ("completions", {"extra_body": {"guided_json": "[" * 50_000}}, "guided_json"),
    ("chat", {"tool_choice": "required"}, "tool_choice"),
    ("chat", {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                 "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ("chat", {"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ("chat", {"tools": [WEATHER], "tool_choice": "required",
              "response_format": {"type": "json_object"}}, "tool_choice"),
]


@pytest.mark.parametrize("stream", [False, True])
def test_malformed_constraints_are_400_naming_the_field(client, stream):
    for endpoint, fields, param in BAD:
        with pytest.raises(openai.BadRequestError) as info:
            if endpoint == "chat":
                _chat(client, stream=stream, **fields)
            else:
                client.completions.create(model="a2", prompt="x", max_tokens=4, stream=stream,
                                          **fields)
        error = info.value.body
        assert error["param"] == param and param.split(".")[0] in error["message"], error
        assert error["type"] == "invalid_request_error"
    out = _chat(client, temperature=0.0)  # nothing else was disturbed
    assert out.choices[0].message.content and out.usage.completion_tokens == 8


def test_grpc_refuses_malformed_constraints_naming_them(served):
    with GenerateClient(served.gateway) as g:
        for kwargs, field in (({"json_schema": "{nope"}, "sampling.structured.json_schema"),
                              ({"choice": []}, "sampling.structured.choice"),
                              ({"regex": ""}, "sampling.structured.regex")):
            with pytest.raises(LoramuxError) as info:
                g.generate("x", "a1", max_tokens=4, **kwargs)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
            assert [f for f, _ in info.value.field_violations] == [field]
        assert len(g.generate("x", "a1", max_tokens=4).token_ids) == 4


def _local_prompt_tokens(files, messages, tools) -> int:
    text = ChatTemplate.from_dir(files["model"]).render(messages, tools=tools)
    return len(Tokenizer.from_dir(files["model"]).encode(text, add_special_tokens=False))


def test_tools_and_calls_in_the_history_are_rendered(client, files):
    """The served prompt is the template's rendering of the tools and of the history's
    call and result, as transformers renders them (arguments parsed, content null)."""
    as_template_sees = [HISTORY[0], {**HISTORY[1], "tool_calls": [
        {**HISTORY[1]["tool_calls"][0], "function": {"name": "weather",
                                                    "arguments": {"city": "Paris"}}}]},
        HISTORY[2]]
    want = _local_prompt_tokens(files, as_template_sees, [WEATHER])
    assert want > _local_prompt_tokens(files, as_template_sees, None)
    for model in (files["model"], "a1", "a2"):
        out = client.chat.completions.create(model=model, messages=HISTORY, tools=[WEATHER],
                                             max_tokens=2, temperature=0.0)
        assert out.usage.prompt_tokens == want, model


def test_auto_tool_choice_serves(client):
    """The tiny model writes no call by itself: auto gives its text, streamed and not."""
    for kwargs in ({}, {"tool_choice": "auto", "parallel_tool_calls": False}):
        out = _chat(client, tools=[WEATHER], temperature=0.0, **kwargs)
        choice = out.choices[0]
        assert choice.finish_reason == "length" and choice.message.tool_calls is None
        stream = _chat(client, tools=[WEATHER], temperature=0.0, stream=True, **kwargs)
        chunks = [c.choices[0] for c in stream if c.choices]
        assert "".join(c.delta.content or "" for c in chunks) == choice.message.content


def test_named_tool_choice_answers_with_a_call(client):
    """The response is a call of the named function, whatever the arguments are (that they
    validate needs the engine's constraint: tests/test_structured_outputs_e2e.py)."""
    named = {"type": "function", "function": {"name": "weather"}}
    out = _chat(client, tools=[WEATHER], tool_choice=named, seed=1, temperature=1.0)
    message = out.choices[0].message
    (call,) = message.tool_calls
    assert message.content is None and call.type == "function"
    assert call.function.name == "weather" and call.id.startswith("chatcmpl-tool-")
    assert out.choices[0].finish_reason in ("tool_calls", "length")
    stream = _chat(client, tools=[WEATHER], tool_choice=named, seed=1, temperature=1.0,
                   stream=True)
    deltas = [d for c in stream if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert deltas[0].function.name == "weather" and deltas[0].id.startswith("chatcmpl-tool-")
    assert {d.index for d in deltas} == {0}
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments


def test_grpc_tools_choose_and_parse_calls(served):
    """Over gRPC (the SDK) as over HTTP: a named function and "required" constrain the
    output and their calls come back parsed; under "auto" the model's own format is parsed
    out of the text, which stays as written; "none" parses nothing; a choice the tools
    cannot serve is INVALID_ARGUMENT naming its ChatMessages field."""
    cities = WEATHER["function"]["parameters"]["properties"]["city"]["enum"]
    written = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    refused = {"type": "function", "function": {"name": "w", "strict": True, "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}
    with GenerateClient(served.gateway) as g:
        out = g.chat(ASK, "a1", tools=[WEATHER], tool_choice="weather", max_tokens=40,
                     temperature=1.0, seed=1)
        [call] = out.tool_calls
        assert call.name == "weather" and json.loads(call.arguments) == json.loads(out.text)
        assert json.loads(call.arguments)["city"] in cities
        out = g.chat(ASK, "a2", tools=[WEATHER], tool_choice="required",
                     parallel_tool_calls=False, max_tokens=60, temperature=1.0, seed=2)
        assert [c.name for c in out.tool_calls] == ["weather"]
        assert json.loads(out.tool_calls[0].arguments)["city"] in cities
        for choice, want in (("auto", [("weather", {"city": "Oslo"})]), ("none", [])):
            out = g.chat(ASK, "a1", tools=[WEATHER], tool_choice=choice, max_tokens=150,
                         regex=re.escape(written))
            assert out.text == written
            assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == want
        for kwargs, field in (
                ({"tools": [WEATHER], "tool_choice": "nope"}, "messages.tool_choice"),
                ({"tool_choice": "required"}, "messages.tool_choice"),
                ({"tools": [{"type": "function", "function": {"description": "x"}}]},
                 "messages.tools"),
                ({"tools": [WEATHER], "tool_choice": "required", "regex": "a"},
                 "messages.tool_choice"),
                ({"tools": [WEATHER, refused]}, "messages.tools")):  # the engine refuses it
            with pytest.raises(LoramuxError) as info:
                g.chat(ASK, "a1", max_tokens=4, **kwargs)
            assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, kwargs
            assert [f for f, _ in info.value.field_violations] == [field], info.value
        assert len(g.chat(ASK, "a1", max_tokens=4).token_ids) == 4


def _cli(served, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "loramux.cli", "generate", "hello",
                           "--gateway", served.gateway, "--max-tokens", "4", *args],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)


def test_cli_constraints_reach_the_gateway(served, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    out = _cli(served, "--json-schema", str(bad))
    assert out.returncode == 1 and "sampling.structured.json_schema" in out.stderr
    assert "INVALID_ARGUMENT" in out.stderr
    good = tmp_path / "schema.json"
    good.write_text(json.dumps({"type": "object"}))
    for flags in (["--json-schema", str(good)], ["--choice", "yes", "--choice", "no"],
                  ["--regex", "[a-z]+"], ["--json-object"]):
        out = _cli(served, *flags)
        assert out.returncode == 0, (flags, out.stderr)
