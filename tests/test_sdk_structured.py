"""The SDK's and the CLI's output constraints and tools, down to the Generate request."""
from __future__ import annotations

import json

import pytest
from loramux import cli
from loramux._request import chat_request, generate_request

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}


@pytest.mark.parametrize("kwargs,kind,value", [
    ({"json_schema": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
    ({"json_schema": '{"type": "string"}'}, "json_schema", '{"type": "string"}'),
    ({"json_object": True}, "json_object", True),
    ({"regex": "[0-9]+"}, "regex", "[0-9]+"),
    ({"grammar": 'start: "a"'}, "grammar", 'start: "a"'),
])
def test_sdk_constraints_set_sampling_structured(kwargs, kind, value):
    req = generate_request("x", None, max_tokens=4, **kwargs)
    assert req.sampling.structured.WhichOneof("kind") == kind
    assert getattr(req.sampling.structured, kind) == value
    assert req.sampling.max_tokens == 4


def test_sdk_structural_tag():
    tag = {"triggers": ["<f="], "structures": [
        {"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"},
        {"begin": "<f=b>", "end": "</f>"}]}
    st = generate_request("x", structural_tag=tag).sampling.structured.structural_tag
    assert list(st.triggers) == ["<f="]
    assert [(s.begin, s.json_schema, s.end) for s in st.structures] == [
        ("<f=a>", '{"type": "object"}', "</f>"), ("<f=b>", "", "</f>")]


def test_sdk_choice_and_none():
    req = generate_request("x", choice=["yes", "no"])
    assert list(req.sampling.structured.choice.choices) == ["yes", "no"]
    empty = generate_request("x", choice=[])  # sent, so the gateway says what is wrong
    assert empty.sampling.structured.WhichOneof("kind") == "choice"
    plain = generate_request("x", json_object=False, regex=None)
    assert not plain.sampling.HasField("structured")


@pytest.mark.parametrize("kwargs", [{"regex": "a", "choice": ["a"]}, {"choice": "yes"},
                                    {"json_scheme": {}}])
def test_sdk_refuses_what_cannot_be_one_constraint(kwargs):
    with pytest.raises(TypeError):
        generate_request("x", **kwargs)


def test_sdk_chat_carries_tools_and_calls():
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    req = chat_request([{"role": "user", "content": "hi"},
                        {"role": "assistant", "tool_calls": [
                            {"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": {"a": 1}}}]},
                        {"role": "tool", "tool_call_id": "c1", "content": "done"}],
                       tools=tools, regex="ok")
    chat = req.messages
    assert json.loads(chat.tools) == tools
    assert not chat.messages[1].HasField("content")
    assert json.loads(chat.messages[1].tool_calls[0].arguments) == {"a": 1}
    assert chat.messages[2].tool_call_id == "c1" and chat.messages[2].content == "done"
    assert req.sampling.structured.regex == "ok"
    assert (chat.tool_choice, chat.single_tool_call) == ("", False)
    named = chat_request([{"role": "user", "content": "hi"}], tools=tools,
                         tool_choice={"type": "function", "function": {"name": "f"}},
                         parallel_tool_calls=False).messages
    assert (named.tool_choice, named.single_tool_call) == ("f", True)
    assert chat_request([], tool_choice="required").messages.tool_choice == "required"


def _generate_args(*flags):
    return cli.build_parser().parse_args(["generate", "prompt", *flags])


def test_cli_flags_map_to_the_sdk(tmp_path):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "a"+')
    cases = [(["--json-schema", str(schema)], "json_schema", json.dumps(SCHEMA)),
             (["--json-object"], "json_object", True),
             (["--regex", "[a-z]+"], "regex", "[a-z]+"),
             (["--grammar", str(grammar)], "grammar", 'start: "a"+')]
    for flags, kind, value in cases:
        req = generate_request("p", **cli.constraint_kwargs(_generate_args(*flags)))
        assert getattr(req.sampling.structured, kind) == value, flags
    args = _generate_args("--choice", "yes", "--choice", "no")
    req = generate_request("p", **cli.constraint_kwargs(args))
    assert list(req.sampling.structured.choice.choices) == ["yes", "no"]
    assert cli.constraint_kwargs(_generate_args()) == {}


def test_cli_refuses_two_constraints_and_missing_files(tmp_path, capsys):
    for flags in (["--regex", "a", "--json-object"],
                  ["--json-schema", str(tmp_path / "absent.json")]):
        with pytest.raises(SystemExit) as info:
            _generate_args(*flags)
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "not allowed with argument" in err and "absent.json" in err
