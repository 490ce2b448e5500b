"""The tool-call parsers on text: each model format, several calls, malformed output left
as content, and the same result however the stream is cut into pieces."""
from __future__ import annotations

import json
import random

import pytest

from loramux_services.gateway.json_scan import JsonScanner
from loramux_services.gateway.tool_calls import (FORMATS, REQUIRED, CallParser, call_of,
                                                 detect_format, parse_all)

HERMES, MISTRAL, LLAMA = FORMATS["hermes"], FORMATS["mistral"], FORMATS["llama3_json"]
WEATHER = {"city": "Paris", "units": ["c", "f"], "note": "a } and a ] in \"quotes\" \\"}

# (format, output, content, [(name, arguments)])
CASES = [
    (HERMES, 'Let me check.\n<tool_call>\n{"name": "weather", "arguments": '
     + json.dumps(WEATHER) + '}\n</tool_call>\n<tool_call>\n{"name": "time", "arguments": '
     '{"tz": "CET"}}\n</tool_call>', "Let me check.\n",
     [("weather", WEATHER), ("time", {"tz": "CET"})]),
    (HERMES, "just text, <tool no call", "just text, <tool no call", []),
    (HERMES, '<tool_call>{"name": "a", "arguments": {}}</tool_call>\nDone. <tool_call>'
     '{"name": "b", "arguments": {"k": 1}}</tool_call>', "Done. ", [("a", {}), ("b", {"k": 1})]),
    (MISTRAL, 'ok[TOOL_CALLS] [{"name": "weather", "arguments": ' + json.dumps(WEATHER)
     + '}, {"name": "time", "arguments": {"tz": "CET"}}]', "ok",
     [("weather", WEATHER), ("time", {"tz": "CET"})]),
    (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {}}]  \n and after', "and after",
     [("a", {})]),
    # the newer Mistral form (tokenizer v11+): one name[ARGS]{arguments} after each marker
    (MISTRAL, "Let me look.[TOOL_CALLS]weather[ARGS]" + json.dumps(WEATHER), "Let me look.",
     [("weather", WEATHER)]),
    (MISTRAL, "[TOOL_CALLS]weather[ARGS]" + json.dumps(WEATHER)
     + '[TOOL_CALLS]time[ARGS]{"tz": "CET"}', "", [("weather", WEATHER), ("time", {"tz": "CET"})]),
    (MISTRAL, '[TOOL_CALLS]time[CALL_ID]a1B2c3D4e[ARGS]{"tz": "CET"}\n[TOOL_CALLS]noop[ARGS]{}',
     "", [("time", {"tz": "CET"}), ("noop", {})]),
    (MISTRAL, '[TOOL_CALLS]run[ARGS]{"cmd": "echo [ARGS] }", "opts": {"env": {"A": "[TOOL_CALLS]"'
     '}, "n": [1, {"k": "}{"}]}}  and done', "and done",
     [("run", {"cmd": "echo [ARGS] }", "opts": {"env": {"A": "[TOOL_CALLS]"},
                                                "n": [1, {"k": "}{"}]}})]),
    # a broken call after good ones: they stay calls, it is content
    (MISTRAL, '[TOOL_CALLS]a[ARGS]{}\n[TOOL_CALLS]b[ARGS]{"x": oops} tail',
     '[TOOL_CALLS]b[ARGS]{"x": oops} tail', [("a", {})]),
    (MISTRAL, '[TOOL_CALLS]a[ARGS]{"k": 1}[TOOL_CALLS]b c', "[TOOL_CALLS]b c", [("a", {"k": 1})]),
    (LLAMA, '<|python_tag|>{"name": "weather", "parameters": ' + json.dumps(WEATHER)
     + '}; {"name": "time", "arguments": {"tz": "CET"}}', "",
     [("weather", WEATHER), ("time", {"tz": "CET"})]),
    (LLAMA, '\n{"name": "time", "parameters": {"tz": "CET"}}\n', "", [("time", {"tz": "CET"})]),
    (LLAMA, 'The answer is {"name": "time"}', 'The answer is {"name": "time"}', []),
    # arguments written as a JSON string are read as the object they hold
    (LLAMA, '{"name": "time", "arguments": "{\\"tz\\": \\"CET\\"}"}', "",
     [("time", {"tz": "CET"})]),
    (REQUIRED, '[{"name": "weather", "parameters": ' + json.dumps(WEATHER)
     + '}, {"name": "time", "parameters": {"tz": "CET"}}]', "",
     [("weather", WEATHER), ("time", {"tz": "CET"})]),
]

MALFORMED = [
    (HERMES, '<tool_call>{"name": oops}</tool_call>'),        # not JSON
    (HERMES, '<tool_call>{"arguments": {}}</tool_call>'),     # no name
    (HERMES, '<tool_call>not an object</tool_call>'),
    (HERMES, '<tool_call>{"name": "a", "arguments": {"x": 1'),  # cut off
    (MISTRAL, '[TOOL_CALLS] sorry'),
    (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": [1, 2]}]'),  # arguments not an object
    (MISTRAL, '[TOOL_CALLS]a[ARGS][1, 2]'),
    (MISTRAL, '[TOOL_CALLS]a[ARGS]{"x": 1'),
    (MISTRAL, '[TOOL_CALLS]a[CALL_ID]x1[ARGS]{"x": }'),
    (MISTRAL, '[TOOL_CALLS]a[ARG]{}'),
    (MISTRAL, '[TOOL_CALLS]a [ARGS]{}'),
    (MISTRAL, "[TOOL_CALLS]" + "a" * 65 + "[ARGS]{}"),  # longer than any function name
    (MISTRAL, 'Call it as f[ARGS]{"x": 1}, after [TOOL_CALLS] or [TOOL_CALLS]f[ARGS] alone.'),
    (LLAMA, '{"name": "a", "parameters": {"x": 1'),
    (LLAMA, '<|python_tag|>print("hi")'),
    (REQUIRED, '[{"name": "a", "parameters": {"x"'),
]


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _fed(fmt, pieces) -> tuple[str, list]:
    parser, content, calls = CallParser(fmt), [], []
    for piece in [*pieces, None]:
        text, found = parser.feed(piece) if piece is not None else parser.finish()
        content.append(text)
        calls.extend(found)
    return "".join(content), calls


@pytest.mark.parametrize("fmt,output,content,calls", CASES)
def test_formats_parse_content_and_calls(fmt, output, content, calls):
    got_content, got_calls = parse_all(fmt, output)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("chatcmpl-tool-") for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("fmt,output", MALFORMED)
def test_malformed_output_is_content(fmt, output):
    content, calls = parse_all(fmt, output)
    assert calls == [] and content == output


def test_a_broken_call_after_good_ones_keeps_them():
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": 1}</tool_call> tail')
    content, calls = parse_all(HERMES, text)
    assert _calls(calls) == [("a", {})]
    assert content == '<tool_call>{"name": 1}</tool_call> tail'


@pytest.mark.parametrize("fmt,output,content,calls", CASES + [(f, o, o, []) for f, o in MALFORMED])
def test_any_cut_gives_the_same_result(fmt, output, content, calls):
    """Cut in two at every point, and in many random pieces (seeded): the streamed content
    and calls are those of the whole text."""
    for at in range(len(output) + 1):
        got = _fed(fmt, [output[:at], output[at:]])
        assert (got[0], _calls(got[1])) == (content, calls), at
    rng = random.Random(len(output))
    for _ in range(100):
        cuts = sorted(rng.sample(range(1, len(output)), rng.randint(1, min(30, len(output) - 1))))
        pieces = [output[a:b] for a, b in zip([0, *cuts], [*cuts, len(output)])]
        got = _fed(fmt, pieces)
        assert (got[0], _calls(got[1])) == (content, calls), pieces


def test_content_streams_before_the_call_is_whole():
    """Text is given back as it comes; only what may begin a marker waits."""
    parser = CallParser(HERMES)
    assert parser.feed("Checking the weather <tool") == ("Checking the weather ", [])
    assert parser.feed('_call>{"name": "w", "arguments": {"c') == ("", [])
    content, calls = parser.feed('": 1}}</tool_call>')
    assert content == "" and _calls(calls) == [("w", {"c": 1})]


def test_a_newer_mistral_call_comes_when_its_arguments_close():
    parser = CallParser(MISTRAL)
    assert parser.feed("Looking [TOOL_") == ("Looking ", [])
    assert parser.feed('CALLS]weather[CALL_ID]a1[AR') == ("", [])
    content, calls = parser.feed('GS]{"city": "Paris"}')
    assert content == "" and _calls(calls) == [("weather", {"city": "Paris"})]
    assert parser.finish() == ("", [])


def test_a_long_unclosed_object_stays_linear():
    """An output that opens a call and never closes it is scanned once per piece, not
    rescanned from its start (a quadratic parser would take minutes here)."""
    parser = CallParser(HERMES)
    parser.feed('<tool_call>{"name": "a", "arguments": {"x": [')
    for _ in range(50_000):
        assert parser.feed('[1, "s}", {"k": 2}],') == ("", [])
    content, calls = parser.finish()
    assert calls == [] and content.startswith("<tool_call>{") and len(content) > 900_000


def test_json_scanner_nesting_and_strings():
    s = JsonScanner()
    assert s.feed('{"a": "}\\"') is None
    assert s.feed('{", "b": [1, {"c": 2}]') is None
    assert s.feed('} trailing') == 1
    assert JsonScanner().feed('[1, [2], "]"] x') == 13


def test_call_of_reads_arguments_or_parameters():
    assert call_of('{"name": "f", "parameters": {"a": 1}}').arguments == '{"a": 1}'
    assert call_of('{"name": "f"}').arguments == "{}"
    assert call_of('{"name": "", "arguments": {}}') is None
    assert call_of('{"name": "f", "arguments": "not json"}') is None
    assert call_of('{"a": 1}', name="f").arguments == '{"a": 1}'  # the arguments alone
    assert call_of("[1]", name="f") is None


@pytest.mark.parametrize("template,name", [
    ("{% for tool in tools %}<tool_call>{{ tool | tojson }}</tool_call>{% endfor %}", "hermes"),
    ("{{ '[TOOL_CALLS]' }}{{ messages }}", "mistral"),
    ("{%- for tool_call in message.tool_calls %}{{- '[TOOL_CALLS]' + tool_call.function.name"
     " + '[ARGS]' + tool_call.function.arguments | tojson }}{%- endfor %}", "mistral"),
    ("{{- '<|python_tag|>' + tool_call.name }}", "llama3_json"),
    ("Given the following functions, please respond with a JSON for a function call", "llama3_json"),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
    (None, None),
])
def test_format_detected_from_the_template(template, name):
    fmt = detect_format(template)
    assert (fmt.name if fmt else None) == name
