"""tool_choice "auto" with a strict tool: the grammar the gateway writes for each call format
(services/gateway/call_grammar.py), compiled by the engine's compiler and walked at random
under its masks; then structural tags, walked the same way. Whatever the walk writes, every call the format's parser finds names a
tool and carries arguments valid under that tool's schema; a walk that opens a call ends
with one (the grammar cannot be left inside a call); the text around calls never spells a
marker out; a malformed call is refused token by token. Markers as plain text and as the
tokenizer's special tokens, Mistral's list form and its name[ARGS] form."""
from __future__ import annotations

import json
import random

import jsonschema
import pytest
from tokenizers import Tokenizer as HfTokenizer

from loramux_core.structured import StructuredOutput
from loramux_core.tokenizer import Tokenizer
from loramux_engine.structured import CompilerConfig, GrammarCompiler
from loramux_services.demo_model import train_byte_level_bpe
from loramux_services.gateway.call_grammar import call_grammar, tag_grammar
from loramux_services.gateway.tool_calls import FORMATS, parse_all
from tests.support.tiny import CORPUS, EOS_ID, SPECIAL_TOKENS

WEATHER = {"type": "object", "properties": {
    "city": {"enum": ["Paris", "Oslo"]}, "unit": {"$ref": "#/$defs/unit"}},
    "required": ["city", "unit"], "additionalProperties": False,
    "$defs": {"unit": {"enum": ["C", "F"]}}}
ALARM = {"type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
         "additionalProperties": False}
CALLS = [("weather", WEATHER), ("alarm", ALARM)]
MARKERS = ["<tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]
# what each walk writes before it draws at random: text, or text that opens a call
OPENERS = {"hermes": ["", "Let me see. ", "Let me see. <tool_call>"],
           "mistral": ["", "ok ", "ok [TOOL_CALLS]"],
           "llama3_json": ["", "Sure", "<|python_tag|>", " {"]}


def _tokenizers(tmp_path_factory):
    out = {}
    for kind, specials in (("text", SPECIAL_TOKENS), ("special", [*SPECIAL_TOKENS, *MARKERS])):
        path = tmp_path_factory.mktemp(kind) / "tokenizer.json"
        train_byte_level_bpe(CORPUS, 384, specials).save(str(path))
        out[kind] = path
    return out


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    paths = _tokenizers(tmp_path_factory)
    compilers = {kind: GrammarCompiler(CompilerConfig(path, 384, (EOS_ID,)))
                 for kind, path in paths.items()}
    yield {kind: (Tokenizer.from_dir(path.parent), HfTokenizer.from_file(str(path)),
                  compilers[kind]) for kind, path in paths.items()}
    for c in compilers.values():
        c.close()


def _matcher(tokenizers, kind: str, fmt: str, parallel: bool):
    vocab, hf, compiler = tokenizers[kind]
    grammar = call_grammar(FORMATS[fmt], CALLS, parallel, vocab)
    return compiler.submit(StructuredOutput("grammar", grammar)).result(timeout=60), vocab, hf


def _allowed(matcher, vocab_size: int = 384) -> list[int]:
    words = memoryview(matcher.compute_bitmask()).cast("I")
    return [t for t in range(vocab_size) if (words[t // 32] >> (t % 32)) & 1]


def _walk(matcher, hf, opener: str, rng: random.Random, limit: int = 400):
    """(the text written, whether the grammar ended) after `opener` then random allowed
    tokens, EOS taken at once whenever it is allowed after a while."""
    m = matcher.deep_copy()
    ids = hf.encode(opener, add_special_tokens=False).ids
    assert m.consume_tokens(ids), m.get_error()
    for step in range(limit):
        allowed = _allowed(m)
        assert allowed, m.get_error()
        if EOS_ID in allowed and (step > 20 or allowed == [EOS_ID]):
            return hf.decode(ids, skip_special_tokens=False), True
        token = rng.choice([t for t in allowed if t != EOS_ID] or allowed)
        assert m.consume_token(token), m.get_error()
        ids.append(token)
    return hf.decode(ids, skip_special_tokens=False), False


@pytest.mark.parametrize("kind", ["text", "special"])
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("fmt", ["hermes", "mistral", "llama3_json"])
def test_every_call_a_walk_writes_is_a_valid_call(tokenizers, kind, fmt, parallel):
    matcher, vocab, hf = _matcher(tokenizers, kind, fmt, parallel)
    schemas = dict(CALLS)
    rng = random.Random(f"{kind}{fmt}{parallel}")
    found = 0
    for opener in OPENERS[fmt]:
        for _ in range(6):
            text, ended = _walk(matcher, hf, opener, rng)
            content, calls = parse_all(FORMATS[fmt], text)
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), {
                    **schemas[call.name], "$defs": WEATHER["$defs"]})
            assert parallel or len(calls) <= 1, text
            for marker in (FORMATS[fmt].marker, FORMATS[fmt].args):
                assert not marker or marker not in content, text  # no spelled-out call
            if opener.strip() and opener.strip()[-1] in ">]{":  # it opened a call
                assert ended and calls, text
            found += len(calls)
    assert found >= 6


@pytest.mark.parametrize("kind", ["text", "special"])
def test_a_malformed_call_is_refused(tokenizers, kind):
    for fmt, bad in (("hermes", 'x <tool_call>{"name": "nope"'),
                     ("hermes", 'x <tool_call>{"name": "alarm", "arguments": {"on": 1'),
                     ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": {"city": "Rome'),
                     ("llama3_json", '{"name": "alarm", "arguments"'),
                     ("llama3_json", 'hi {"x": 1} and more')):
        matcher, _, hf = _matcher(tokenizers, kind, fmt, True)
        m = matcher.deep_copy()
        ids = hf.encode(bad, add_special_tokens=False).ids
        if fmt == "llama3_json" and bad.startswith("hi"):
            assert m.consume_tokens(ids)  # a call only at the start: the rest is text
            continue
        assert not m.consume_tokens(ids), (fmt, bad)


def test_mistral_form_follows_the_vocabulary(tokenizers):
    """[ARGS] in the vocabulary: the newer name[ARGS]{...} form, else the list."""
    for kind, opener in (("special", "[TOOL_CALLS]weather[ARGS]{"),
                         ("text", '[TOOL_CALLS][{"name": "weather", "arguments": {')):
        matcher, _, hf = _matcher(tokenizers, kind, "mistral", True)
        m = matcher.deep_copy()
        assert m.consume_tokens(hf.encode(opener, add_special_tokens=False).ids), kind
        other = ("text", '[TOOL_CALLS][{"name"') if kind == "special" else \
            ("text", "[TOOL_CALLS]weather[ARGS]")
        m = matcher.deep_copy()
        assert not m.consume_tokens(hf.encode(other[1], add_special_tokens=False).ids), kind


TAGS = [("<f=weather>", WEATHER, "</f>"), ("<f=alarm>", ALARM, "</f>"), ("@", ALARM, ";")]


def _tag_parts(text: str, triggers: list[str]):
    """Each structure in `text` as (begin, value), found as the grammar must have put
    them: at the first trigger from where the last one ended; AssertionError if a trigger
    is not followed by a whole structure."""
    found, at = [], 0
    while True:
        hits = [(text.find(t, at), t) for t in triggers if text.find(t, at) >= 0]
        if not hits:
            return found
        pos = min(hits)[0]
        begin, schema, end = next(s for s in TAGS if text.startswith(s[0], pos))
        value, stop = json.JSONDecoder().raw_decode(text, pos + len(begin))
        assert text.startswith(end, stop), text
        jsonschema.validate(value, {**schema, "$defs": WEATHER["$defs"]})
        found.append((begin, value))
        at = stop + len(end)


def test_structural_tags_hold_what_follows_each_trigger(tokenizers):
    _, hf, compiler = tokenizers["text"]
    triggers = ["<f=", "@"]
    grammar = tag_grammar(TAGS, triggers)
    matcher = compiler.submit(StructuredOutput("grammar", grammar)).result(timeout=60)
    rng = random.Random(7)
    found = 0
    for opener in ("", "so ", "so <f=", "mail @", "a <f=alarm>"):
        for _ in range(6):
            text, ended = _walk(matcher, hf, opener, rng)
            parts = _tag_parts(text, triggers)
            if any(t in opener for t in triggers):
                assert ended and parts, text
            found += len(parts)
    assert found >= 18
    m = matcher.deep_copy()  # a trigger goes on as a structure or not at all
    assert not m.consume_tokens(hf.encode("x <f=nope>", add_special_tokens=False).ids)


@pytest.mark.parametrize("trigger", ["\n<f>", "\r\n", "\t#", "a b", "&~", "x-y", "</f", "\\(",
                                     "é", "\\", "[x]", '"q"', "\x00", "/*", "$^.|?"])
def test_any_trigger_text_is_matched_literally(tokenizers, trigger):
    """Triggers and begins are the caller's text: line breaks, regex and Lark syntax
    characters and quotes are only characters."""
    _, hf, compiler = tokenizers["text"]
    grammar = tag_grammar([(trigger + "!", {"enum": [1]}, ";")], [trigger])
    matcher = compiler.submit(StructuredOutput("grammar", grammar)).result(timeout=60)
    m = matcher.deep_copy()
    assert m.consume_tokens(hf.encode(f"hi {trigger}!1; ok", add_special_tokens=False).ids)
    assert m.is_accepting()
    m = matcher.deep_copy()
    assert not m.consume_tokens(hf.encode(f"hi {trigger}?", add_special_tokens=False).ids)
