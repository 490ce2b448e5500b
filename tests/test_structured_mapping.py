"""The HTTP fields that constrain the output and the tools, mapped onto the Generate
request: each form, and each malformed one refused naming its field."""
from __future__ import annotations

import dataclasses
import json

import grpc
import pytest
from loramux.v1 import generate_pb2

from loramux_services.gateway.chat_tools import required_schema, strict_constraint
from loramux_services.gateway.errors import BadParam, Rejected
from loramux_services.gateway.http_api import ApiError
from loramux_services.gateway.openai_schema import ChatCompletionRequest, CompletionRequest
from loramux_services.gateway.tool_calls import FORMATS
from loramux_services.gateway.validation import check_sampling

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
MESSAGES = [{"role": "user", "content": "hi"}]
WEATHER = {"type": "function", "function": {
    "name": "weather", "description": "the weather",
    "parameters": {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                   "required": ["city"], "$defs": {"City": {"type": "string"}}}}}
TIME = {"type": "function", "function": {"name": "time"}}


def _structured(**fields) -> generate_pb2.StructuredOutput:
    body = CompletionRequest(model="m", prompt="x", **fields)
    (req,) = body.generate_requests("")
    return req.sampling.structured


def _chat(**fields) -> tuple[ChatCompletionRequest, generate_pb2.GenerateRequest]:
    body = ChatCompletionRequest(model="m", messages=fields.pop("messages", MESSAGES), **fields)
    (req,) = body.generate_requests("")
    return body, req


@pytest.mark.parametrize("fields,kind,spec", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": SCHEMA, "strict": True}}}, "json_schema", SCHEMA),
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"structured_outputs": {"json": SCHEMA}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "[a-z]+"),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, "choice", ["yes", "no"]),
    ({"structured_outputs": {"grammar": "start: \"a\"+"}}, "grammar", "start: \"a\"+"),
    ({"structured_outputs": {"json_object": True, "disable_fallback": True}}, "json_object", True),
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA),
    ({"guided_regex": "\\d+"}, "regex", "\\d+"),
    ({"guided_choice": ["a", "b"]}, "choice", ["a", "b"]),
    ({"guided_grammar": "start: \"x\""}, "grammar", "start: \"x\""),
])
def test_each_form_maps_onto_sampling_structured(fields, kind, spec):
    pb = _structured(**fields)
    assert pb.WhichOneof("kind") == kind
    got = {"json_schema": lambda: json.loads(pb.json_schema),
           "choice": lambda: list(pb.choice.choices)}.get(kind, lambda: getattr(pb, kind))()
    assert got == spec
    _, req = _chat(**fields)  # chat takes the same fields
    assert req.sampling.structured == pb


def test_text_and_nothing_leave_the_output_free():
    assert not _structured(response_format={"type": "text"}).WhichOneof("kind")
    body = CompletionRequest(model="m", prompt="x")
    assert not body.generate_requests("")[0].sampling.HasField("structured")


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": "{nope"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
     "response_format.json_schema.extra"),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": "[" * 100_000}}, "structured_outputs.json"),
    ({"guided_json": "not json"}, "guided_json"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
])
def test_malformed_forms_name_their_field(fields, param):
    with pytest.raises(BadParam) as info:
        CompletionRequest(model="m", prompt="x", **fields).generate_requests("")
    assert info.value.param == param
    assert param.split(".")[0] in str(info.value)


@pytest.mark.parametrize("structured,field", [
    (generate_pb2.StructuredOutput(json_schema="{nope"), "sampling.structured.json_schema"),
    (generate_pb2.StructuredOutput(json_schema="[" * 100_000), "sampling.structured.json_schema"),
    (generate_pb2.StructuredOutput(json_schema="3"), "sampling.structured.json_schema"),
    (generate_pb2.StructuredOutput(regex=""), "sampling.structured.regex"),
    (generate_pb2.StructuredOutput(grammar="x" * (256 * 1024 + 1)), "sampling.structured.grammar"),
    (generate_pb2.StructuredOutput(choice=generate_pb2.Choices()), "sampling.structured.choice"),
    (generate_pb2.StructuredOutput(choice=generate_pb2.Choices(choices=["a", ""])),
     "sampling.structured.choice"),
])
def test_grpc_form_checks_name_sampling_structured(structured, field):
    """The gateway's check of a Generate request's constraint: INVALID_ARGUMENT naming it
    (a schema nested past the JSON parser's depth included)."""
    with pytest.raises(Rejected) as info:
        check_sampling(generate_pb2.SamplingParams(structured=structured), 1000)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.field == field and str(info.value).startswith(field)


def test_refusals_of_a_constraint_name_the_http_field():
    """The gateway's form check or the engine's compiler name sampling.structured.<kind>;
    the HTTP API names the field the user sent."""
    engine = Rejected.from_wire(grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                "sampling.structured.json_schema: unknown type 'foo'")
    assert engine.field == "sampling.structured.json_schema"
    err = ApiError.from_rejected(engine, "response_format.json_schema.schema")
    assert (err.status, err.param) == (400, "response_format.json_schema.schema")
    assert str(err) == "response_format.json_schema.schema: unknown type 'foo'"
    other = ApiError.from_rejected(Rejected.from_wire(3, "sampling.top_p=2.0: too big"), "x")
    assert other.param == "top_p"


def test_tools_render_and_history_carries_calls():
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "c1", "type": "function",
                    "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    body, req = _chat(messages=history, tools=[WEATHER, TIME])
    chat = req.messages
    assert [t["function"]["name"] for t in json.loads(chat.tools)] == ["weather", "time"]
    assistant, tool = chat.messages[1], chat.messages[2]
    assert not assistant.HasField("content")
    assert [(c.id, c.name, json.loads(c.arguments)) for c in assistant.tool_calls] == \
        [("c1", "weather", {"city": "Paris"})]
    assert tool.tool_call_id == "c1" and tool.content == "sunny"
    assert body.plan.mode == "auto" and not req.sampling.HasField("structured")


def test_named_and_required_are_enforced_by_a_schema():
    body, req = _chat(tools=[WEATHER, TIME],
                      tool_choice={"type": "function", "function": {"name": "weather"}})
    assert (body.plan.mode, body.plan.function) == ("named", "weather")
    assert json.loads(req.sampling.structured.json_schema) == WEATHER["function"]["parameters"]
    assert body.constraint_param == "tools[0].function.parameters"
    body, req = _chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(req.sampling.structured.json_schema)
    assert schema == required_schema([t for t in body.tools], parallel=False)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert schema["$defs"] == {"City": {"type": "string"}}  # where #/$defs/City points
    names = [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]]
    assert names == [["weather"], ["time"]]
    body, req = _chat(tools=[WEATHER], tool_choice="none")
    assert body.plan is None and not req.sampling.HasField("structured")


class _Vocab:
    """A tokenizer with no special tokens and no [ARGS]."""
    def token_to_id(self, text):
        return None

    def is_special(self, token_id):
        return False


def test_a_strict_tool_constrains_auto_only_where_the_format_is_known():
    strict = {"type": "function", "function": {**WEATHER["function"], "strict": True}}
    for tools, fmt, want in (([WEATHER, TIME], "hermes", False), ([strict, TIME], None, False),
                             ([strict, TIME], "hermes", True), ([strict, TIME], "mistral", True)):
        body, _ = _chat(tools=tools)
        plan = dataclasses.replace(body.plan, fmt=FORMATS.get(fmt))
        c = strict_constraint(plan, body.tools, _Vocab())
        assert (c is not None) == want, (tools, fmt)
        if want:  # time is not strict: its arguments are any object
            grammar = c.structured.grammar
            assert c.param == "tools" and grammar.count("%json") == 1
            schema = json.loads(grammar.split("%json ")[1].splitlines()[0])
            calls = schema["items"]["anyOf"] if fmt == "mistral" else schema["anyOf"]
            assert [i["properties"]["arguments"] for i in calls] == [
                {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}},
                 "required": ["city"]}, {"type": "object"}]
            assert schema["$defs"] == {"City": {"type": "string"}}
    body, _ = _chat(tools=[strict, TIME], tool_choice="required")
    assert strict_constraint(body.plan, body.tools, _Vocab()) is None  # the schema's job


TAG = {"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}],
       "triggers": ["<f="]}


def test_structural_tags_become_their_grammar():
    for fields, param in (({"response_format": {"type": "structural_tag", **TAG}},
                           "response_format"),
                          ({"structured_outputs": {"structural_tag": json.dumps(TAG)}},
                           "structured_outputs.structural_tag")):
        body, req = _chat(**fields)
        grammar = req.sampling.structured.grammar
        assert body.constraint_param == param and "%json" in grammar and '"a>"' in grammar


@pytest.mark.parametrize("tag,param", [
    ({**TAG, "triggers": []}, "triggers"),
    ({**TAG, "triggers": ["<g="]}, "structures[0].begin"),
    ({**TAG, "triggers": ["<f=", "<g="]}, "triggers[1]"),
    ({**TAG, "structures": [{"begin": "<f=", "schema": [1], "end": ""}]}, "structures[0].schema"),
    ({**TAG, "structures": [{"begin": "<f=", "end": 3}]}, "structures[0]"),
    ({**TAG, "structures": []}, "structures"),
    ({**TAG, "format": {}}, "format"),
])
def test_malformed_structural_tags_name_their_field(tag, param):
    with pytest.raises(BadParam) as info:
        _chat(response_format={"type": "structural_tag", **tag})
    assert info.value.param == f"response_format.{param}"
    with pytest.raises(BadParam) as info:
        _chat(structured_outputs={"structural_tag": tag})
    assert info.value.param == f"structured_outputs.structural_tag.{param}"


@pytest.mark.parametrize("fields,param", [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [TIME] * 129}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "w2", "parameters": {
        "$defs": {"City": {"type": "integer"}}}}}], "tool_choice": "required"},
     "tools[1].function.parameters.$defs.City"),
])
def test_bad_tool_requests_name_their_field(fields, param):
    with pytest.raises(BadParam) as info:
        _chat(**fields)
    assert info.value.param == param
