"""Chat templates: rendered and tokenized as Hugging Face's apply_chat_template does (same
ids, BOS once), adapter templates over the base model's, the sandbox, and tokenization off
the event loop."""
from __future__ import annotations

import asyncio
import json
import shutil
import threading

import grpc
import pytest
from loramux.v1 import generate_pb2
from tokenizers import Tokenizer as Backend
from tokenizers import processors

from loramux_core.tokenizer import Tokenizer
from loramux_core.v1 import engine_pb2
from loramux_services.common.chat_template import ChatTemplate, ChatTemplateError
from loramux_services.gateway.errors import Rejected
from loramux_services.gateway.prompts import PromptBuilder
from loramux_services.gateway.validation import encode_text
from tests.support.tiny import TinySpec, make_model

# The shapes of real templates: BOS written by the template, a system prompt folded into
# the first turn, raise_exception on bad roles, loop controls, tojson, namespace.
CHATML = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
    "{% set rest = messages[1:] %}{% else %}{% set sys = false %}{% set rest = messages %}{% endif %}"
    "{% for m in rest %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}"
    "{% if loop.index0 == 0 and sys %}{% set content = '<<SYS>>\\n' + sys + '\\n<</SYS>>\\n\\n' + m['content'] %}"
    "{% else %}{% set content = m['content'] %}{% endif %}"
    "{% if m['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% else %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}")
FANCY = (
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
    "{% set ns.n = ns.n + 1 %}{{ ns.n }}:{{ m | tojson }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}")
CHATS = [
    [{"role": "user", "content": "héllo wörld, ça va?"}],
    [{"role": "system", "content": "a tiny model that could"},
     {"role": "user", "content": "the quick brown fox"},
     {"role": "assistant", "content": "jumps over the lazy dog."},
     {"role": "user", "content": "你好，世界。 🙂"}],
]


def _with_template(src, dst, template: str | None, *, in_jinja_file: bool = False):
    shutil.copytree(src, dst)
    if template is None:
        return dst
    if in_jinja_file:
        (dst / "chat_template.jinja").write_text(template)
    else:
        config = json.loads((dst / "tokenizer_config.json").read_text())
        config["chat_template"] = template
        (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny model whose tokenizer adds BOS (like Llama's), so a doubled BOS would show."""
    path = make_model(tmp_path_factory.mktemp("chat") / "model", TinySpec())
    tok = Backend.from_file(str(path / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 0)])
    tok.save(str(path / "tokenizer.json"))
    return path


def _builder(model_dir) -> PromptBuilder:
    return PromptBuilder(Tokenizer.from_dir(model_dir), str(model_dir), workers=1)


def _chat_request(messages, **kw) -> generate_pb2.GenerateRequest:
    req = generate_pb2.GenerateRequest()
    for m in messages:
        req.messages.messages.add(role=m["role"], content=m["content"])
    for k, v in kw.items():
        setattr(req.messages, k, v)
    return req


def _ids(builder, req, entry=None) -> list[int]:
    return asyncio.run(builder.token_ids(req, entry, 1024, builder.tokenizer.vocab_size))


@pytest.mark.parametrize("in_jinja_file", [False, True])
@pytest.mark.parametrize("template", [CHATML, LLAMA2, FANCY], ids=["chatml", "llama2", "fancy"])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_same_ids_as_transformers(model_dir, tmp_path, template, in_jinja_file, generation_prompt):
    from transformers import AutoTokenizer

    path = _with_template(model_dir, tmp_path / "m", template, in_jinja_file=in_jinja_file)
    hf = AutoTokenizer.from_pretrained(path)
    builder = _builder(path)
    for messages in CHATS:
        want = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                      tokenize=True, return_dict=False)
        got = _ids(builder, _chat_request(messages, add_generation_prompt=generation_prompt))
        assert got == list(want)
        if template != LLAMA2:  # (LLAMA2 writes one per user turn)
            assert got.count(0) == template.count("bos_token")
        text = hf.apply_chat_template(messages, add_generation_prompt=generation_prompt,
                                      tokenize=False)
        assert builder.render_chat(_chat_request(messages, add_generation_prompt=generation_prompt)
                                   .messages, None) == text


def test_bos_never_doubled(model_dir, tmp_path):
    builder = _builder(_with_template(model_dir, tmp_path / "m", CHATML))
    req = _chat_request(CHATS[0])
    ids = _ids(builder, req)
    assert ids[0] == 0 and ids[1] != 0
    # The same chat rendered by the client and sent as text: the tokenizer's BOS is not added
    # in front of the template's own, while a plain text prompt still gets one.
    rendered = builder.render_chat(req.messages, None)
    assert encode_text(builder.tokenizer, rendered) == ids
    plain = encode_text(builder.tokenizer, "the quick brown fox")
    assert plain[0] == 0 and plain[1] != 0


def test_adapter_template_overrides_base(model_dir, tmp_path):
    builder = _builder(_with_template(model_dir, tmp_path / "m", CHATML))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] ")
    own = engine_pb2.AdapterTableEntry(name="own", id=7, path=str(adapter))
    plain = engine_pb2.AdapterTableEntry(name="plain", id=8, path=str(model_dir))
    chat = _chat_request(CHATS[0]).messages
    assert builder.render_chat(chat, own) == "[user] héllo wörld, ça va?\n[assistant] "
    assert builder.render_chat(chat, plain) == builder.render_chat(chat, None)
    assert builder.render_chat(chat, None).startswith("<s><|user|>")


def test_continue_final_message(model_dir, tmp_path):
    builder = _builder(_with_template(model_dir, tmp_path / "m", CHATML))
    messages = [*CHATS[0], {"role": "assistant", "content": "once upon"}]
    text = builder.render_chat(_chat_request(messages, continue_final_message=True).messages, None)
    assert text.endswith("<|assistant|>\nonce upon")


def test_refusals(model_dir, tmp_path):
    no_template = _builder(model_dir)
    with pytest.raises(Rejected) as info:
        _ids(no_template, _chat_request(CHATS[0]))
    assert info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "no chat template" in str(info.value)
    llama = _builder(_with_template(model_dir, tmp_path / "m", LLAMA2))
    with pytest.raises(Rejected) as info:  # the template's own raise_exception
        _ids(llama, _chat_request([{"role": "assistant", "content": "hi"}]))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "roles must alternate" in str(info.value)
    for bad in (_chat_request([]), _chat_request([{"role": "", "content": "x"}])):
        with pytest.raises(Rejected) as info:
            _ids(llama, bad)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("escape", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__ }}{{ cycler.__init__.__globals__ }}",
    "{% set x = messages.append(1) %}",  # the environment is immutable
])
def test_sandbox_refuses_escapes(escape):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])


def test_template_that_does_not_compile(model_dir, tmp_path):
    with pytest.raises(ChatTemplateError):
        PromptBuilder(Tokenizer.from_dir(model_dir),
                      str(_with_template(model_dir, tmp_path / "m", "{% for %}")))


def test_tokenization_runs_off_the_event_loop(model_dir):
    builder = _builder(model_dir)
    seen = []
    encode = builder.tokenizer.encode

    def recording_encode(text, *a, **kw):
        seen.append(threading.current_thread())
        return encode(text, *a, **kw)

    builder.tokenizer.encode = recording_encode

    async def main():
        req = generate_pb2.GenerateRequest(text="the quick brown fox " * 100)
        ids = await builder.token_ids(req, None, 1 << 20, builder.tokenizer.vocab_size)
        return ids, threading.current_thread()

    ids, loop_thread = asyncio.run(main())
    assert len(ids) > 100 and seen and all(t is not loop_thread for t in seen)


def test_prompts_far_over_the_limit_are_refused_without_tokenizing(model_dir):
    builder = _builder(model_dir)
    calls = []
    builder.tokenizer.encode = lambda *a, **kw: calls.append(a) or [1]
    big = "the quick brown fox " * 20_000  # 400,000 characters for a 1024-token model
    for req, field in ((generate_pb2.GenerateRequest(text=big), "text"),
                       (_chat_request([{"role": "user", "content": big}]), "messages.messages"),
                       (generate_pb2.GenerateRequest(token_ids=generate_pb2.TokenIds(ids=[5] * 1024)),
                        "token_ids.ids")):
        with pytest.raises(Rejected) as info:
            _ids_with_limit(builder, req, 1024)
        assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.field == field and "limit is 1024" in str(info.value)
    assert calls == []
    _ids_with_limit(builder, generate_pb2.GenerateRequest(text="the quick brown fox"), 1024)
    assert len(calls) == 1  # a prompt that may fit is tokenized


def _ids_with_limit(builder, req, max_len) -> list[int]:
    return asyncio.run(builder.token_ids(req, None, max_len, builder.tokenizer.vocab_size))
