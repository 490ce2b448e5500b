"""A chat choice's output turned into content and tool calls: whole, and as OpenAI's
stream chunks cut at any point; the tools and calls as the chat template sees them."""
from __future__ import annotations

import json
import random

import pytest
from loramux.v1 import generate_pb2

from loramux_services.common.chat_template import ChatTemplate
from loramux_services.gateway.chat_tools import ToolPlan
from loramux_services.gateway.openai_responses import Shape
from loramux_services.gateway.prompts import template_messages, template_tools
from loramux_services.gateway.tool_calls import FORMATS, REQUIRED
from loramux_services.gateway.tool_output import ChoiceTools

HERMES_OUT = ('I will look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
              '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>')
REQUIRED_OUT = '[{"name": "weather", "parameters": {"city": "Oslo"}}]'
NAMED_OUT = '{"city": "Rome", "days": 3}'


def _responses(text: str, rng: random.Random) -> list[generate_pb2.GenerateResponse]:
    cuts = sorted(rng.sample(range(1, len(text)), min(12, len(text) - 1)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    out = [generate_pb2.GenerateResponse(text=p, token_ids=[i]) for i, p in enumerate(pieces)]
    out[-1].finish_reason = generate_pb2.FINISH_REASON_EOS
    return out


def _stream(plan: ToolPlan, text: str, seed: int) -> tuple[str, dict, list[str | None]]:
    """The content, the calls ({index: (id, name, arguments)}) and finish reasons a client
    assembles from the chunks."""
    shape = Shape(True, "m", tokenizer=None, tools=plan)
    choice = shape.choice(0)
    content, calls, reasons = [], {}, []
    for resp in _responses(text, random.Random(seed)):
        choice.add(resp)
        for chunk in shape.chunks(choice, resp):
            item = chunk["choices"][0]
            reasons.append(item["finish_reason"])
            content.append(item["delta"].get("content") or "")
            for d in item["delta"].get("tool_calls", ()):
                have = calls.setdefault(d["index"], [None, None, ""])
                if "id" in d:
                    assert have[0] is None and d["type"] == "function"  # the head comes once
                    have[0], have[1] = d["id"], d["function"]["name"]
                have[2] += d["function"]["arguments"]
    return "".join(content), {k: tuple(v) for k, v in calls.items()}, reasons


@pytest.mark.parametrize("seed", range(20))
def test_streamed_calls_equal_the_whole_response(seed):
    for plan, text in ((ToolPlan("auto", fmt=FORMATS["hermes"]), HERMES_OUT),
                       (ToolPlan("required"), REQUIRED_OUT),
                       (ToolPlan("named", "weather"), NAMED_OUT)):
        content, calls, reasons = _stream(plan, text, seed)
        whole_content, whole = ChoiceTools(plan).whole(text)
        assert content == (whole_content or "")
        assert [(n, json.loads(a)) for _, n, a in calls.values()] == \
            [(c.name, json.loads(c.arguments)) for c in whole]
        assert all(i.startswith("chatcmpl-tool-") for i, _, _ in calls.values())
        assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


def test_whole_responses():
    shape = Shape(True, "m", None, tools=ToolPlan("auto", fmt=FORMATS["hermes"]))
    choice = shape.choice(0)
    choice.add(generate_pb2.GenerateResponse(text=HERMES_OUT,
                                             finish_reason=generate_pb2.FINISH_REASON_EOS))
    (item,) = shape.response([choice], {})["choices"]
    assert item["finish_reason"] == "tool_calls"
    assert item["message"]["content"] == "I will look.\n"
    assert [c["function"]["name"] for c in item["message"]["tool_calls"]] == ["weather", "time"]
    content, calls = ChoiceTools(ToolPlan("named", "weather")).whole(NAMED_OUT)
    assert content is None and calls[0].arguments == NAMED_OUT and calls[0].name == "weather"
    content, calls = ChoiceTools(ToolPlan("required")).whole(REQUIRED_OUT)
    assert content is None and json.loads(calls[0].arguments) == {"city": "Oslo"}


def test_parallel_false_keeps_the_first_call():
    plan = ToolPlan("auto", parallel=False, fmt=FORMATS["hermes"])
    assert [c.name for c in ChoiceTools(plan).whole(HERMES_OUT)[1]] == ["weather"]
    _, calls, _ = _stream(plan, HERMES_OUT, 0)
    assert [name for _, name, _ in calls.values()] == ["weather"]


def test_no_format_and_malformed_output_stay_content():
    shape = Shape(True, "m", None, tools=ToolPlan("auto", fmt=None))
    assert shape.choice(0).tools is None  # nothing to parse: the plain chat path
    text = '<tool_call>{"name": 1}</tool_call> and text'
    content, calls, reasons = _stream(ToolPlan("auto", fmt=FORMATS["hermes"]), text, 3)
    assert (content, calls, reasons[-1]) == (text, {}, "stop")


def test_a_cut_off_call_finishes_with_length():
    plan = ToolPlan("required")
    shape = Shape(True, "m", None, tools=plan)
    choice = shape.choice(0)
    resp = generate_pb2.GenerateResponse(text=REQUIRED_OUT[:20],
                                         finish_reason=generate_pb2.FINISH_REASON_LENGTH)
    choice.add(resp)
    (chunk,) = shape.chunks(choice, resp)
    assert chunk["choices"][0]["finish_reason"] == "length"
    assert chunk["choices"][0]["delta"] == {"content": REQUIRED_OUT[:20]}
    assert REQUIRED is ChoiceTools(plan).fmt


TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
            "{% for m in messages %}{{ m.role }}:"
            "{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}"
            "</tool_call>{% endfor %}{% elif m.role == 'tool' %}[{{ m.tool_call_id }}]{{ m.content }}"
            "{% else %}{{ m.content }}{% endif %}\n{% endfor %}")


def test_the_template_sees_tools_and_calls_as_transformers_gives_them():
    chat = generate_pb2.ChatMessages(tools=json.dumps(
        [{"type": "function", "function": {"name": "weather"}}]))
    chat.messages.add(role="user", content="hi")
    call = chat.messages.add(role="assistant")
    call.tool_calls.add(id="c1", name="weather", arguments='{"city": "Paris"}')
    chat.messages.add(role="tool", content="sunny", tool_call_id="c1")
    messages = template_messages(chat)
    assert messages[1]["content"] is None
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = ChatTemplate(TEMPLATE).render(messages, tools=template_tools(chat))
    # (trim_blocks, as transformers renders: no newline right after a block tag)
    assert text == ('TOOLS:weather;user:hiassistant:<tool_call>{"name": "weather", '
                    '"arguments": {"city": "Paris"}}</tool_call>tool:[c1]sunny')
