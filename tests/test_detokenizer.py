"""Incremental detokenization on the tiny byte-level BPE tokenizer: multi-byte characters
split across tokens, stop strings across token boundaries, held-back text."""
from __future__ import annotations

import random

import pytest

from loramux_engine.detokenizer import IncrementalDetokenizer

TEXTS = [
    "héllo wörld, ça va? naïve café.",
    "你好，世界。 こんにちは",
    "rockets 🙂🚀 and more 🙂🚀🙂",
    "the quick brown fox jumps over the lazy dog. 🚀 é 你好",
    "mixed: a🙂b你c é",
]


def stream(tok, prompt, ids, chunk_sizes=None, **kw):
    """Push ids in chunks; return (deltas, final flush, detokenizer)."""
    detok = IncrementalDetokenizer(tok, prompt, **kw)
    deltas, i = [], 0
    sizes = iter(chunk_sizes or [])
    while i < len(ids):
        n = next(sizes, 1)
        deltas.append(detok.push(ids[i:i + n]))
        i += n
    return deltas, detok.finish(), detok


def test_multibyte_characters_really_are_split_across_tokens(tok):
    # Guard: without split characters the streaming tests below would prove little.
    split = [t for text in TEXTS for t in tok.encode(text) if "\ufffd" in tok.decode([t])]
    assert len(split) >= 5


@pytest.mark.parametrize("text", TEXTS)
def test_one_by_one_equals_full_decode_and_no_partial_characters(tok, text):
    prompt = tok.encode("once upon a time ")
    ids = tok.encode(text)
    deltas, tail, _ = stream(tok, prompt, ids)
    assert "".join(deltas) + tail == tok.decode(ids) == text
    assert tail == ""
    assert all("\ufffd" not in d for d in deltas)


def test_random_chunks_and_special_tokens(tok):
    rng = random.Random(0)
    eos = tok.eos_token_ids[0]
    for text in TEXTS:
        ids = tok.encode(text)
        ids = ids[:3] + [eos] + ids[3:] + [eos]
        sizes = [rng.randint(1, 4) for _ in ids]
        deltas, tail, _ = stream(tok, [], ids, sizes)
        assert "".join(deltas) + tail == tok.decode(ids) == text
        assert all("\ufffd" not in d for d in deltas)
        kept, tail, _ = stream(tok, [], ids, sizes, skip_special_tokens=False)
        assert "".join(kept) + tail == tok.decode(ids, skip_special_tokens=False)
        assert "</s>" in "".join(kept) + tail


def test_arbitrary_ids_lose_nothing(tok):
    # Random ids make invalid byte sequences too; the stream still adds up to the decode.
    rng = random.Random(1)
    for _ in range(30):
        ids = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(1, 25))]
        prompt = [rng.randrange(3, tok.vocab_size) for _ in range(rng.randint(0, 8))]
        deltas, tail, _ = stream(tok, prompt, ids)
        assert "".join(deltas) + tail == tok.decode(ids)


def test_incomplete_character_is_held_then_released(tok):
    ids = tok.encode("a🚀")
    detok = IncrementalDetokenizer(tok, [])
    outs = [detok.push([t]) for t in ids]
    assert "".join(outs) == "a🚀" and outs[-1].endswith("🚀")
    assert all(o in ("", "a", "🚀", "a🚀") for o in outs)
    # A stream cut inside a character flushes the bytes it has (as U+FFFD), not nothing.
    cut = IncrementalDetokenizer(tok, [])
    partial = [t for t in ids if "\ufffd" in tok.decode([t])][:1]
    assert cut.push(partial) == ""
    assert cut.finish() == tok.decode(partial) and "\ufffd" in tok.decode(partial)


def expected_with_stop(full: str, stops, include: bool) -> str:
    """Reference: the first stop string to complete (longest on a tie) cuts the text."""
    for end in range(1, len(full) + 1):
        hits = [s for s in stops if full[:end].endswith(s)]
        if hits:
            s = max(hits, key=len)
            return full[:end] if include else full[:end - len(s)]
    return full


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_tokens(tok, include):
    text = "the quick brown fox jumps over the lazy dog."
    ids = tok.encode(text)
    stop = "fox jum"
    assert not any(stop in tok.decode([t]) for t in ids)  # it really spans tokens
    deltas, tail, detok = stream(tok, [], ids, stop=(stop,), include_stop_str_in_output=include)
    out = "".join(deltas) + tail
    assert out == ("the quick brown fox jum" if include else "the quick brown ")
    assert detok.stop_hit and detok.stop_str == stop and tail == ""


def test_stop_at_the_very_start(tok):
    detok = IncrementalDetokenizer(tok, tok.encode("say "), stop=("hé",))
    out = [detok.push([t]) for t in tok.encode("héllo wörld")]
    assert out == [""] * len(out) and detok.stop_hit
    assert detok.push(tok.encode(" more")) == ""  # nothing after a stop
    assert detok.finish() == "" and detok.text == ""


def test_stop_inside_a_multibyte_character_sequence(tok):
    ids = tok.encode("rockets 🙂🚀 and more")
    deltas, tail, detok = stream(tok, [], ids, stop=("🚀",))
    assert "".join(deltas) + tail == "rockets 🙂" and detok.stop_hit


def test_held_back_prefix_is_released_when_not_a_stop(tok):
    ids = tok.encode("the lazy dog. the lazy cat")
    detok = IncrementalDetokenizer(tok, [], stop=("lazy cat!",))
    deltas = [detok.push([t]) for t in ids]
    emitted = "".join(deltas)
    # "lazy " could begin the stop string: the first one is released once "dog" arrives,
    # the second one is still held when the stream ends, and finish() releases it.
    assert emitted.startswith("the lazy dog.")
    assert not emitted.endswith("cat")
    tail = detok.finish()
    assert emitted + tail == "the lazy dog. the lazy cat" and not detok.stop_hit


def test_text_that_cannot_start_a_stop_is_not_held(tok):
    detok = IncrementalDetokenizer(tok, [], stop=("xyz",))
    out = "".join(detok.push(t) for t in tok.encode("hello world"))  # one int at a time
    assert out == "hello world"


def test_first_completed_stop_wins(tok):
    ids = tok.encode("once upon a time there was")
    for stops in [("upon a time", "on a"), ("time", "once"), ("a time there", "e there")]:
        for include in (False, True):
            for sizes in (None, [len(ids)]):
                deltas, tail, _ = stream(tok, [], ids, sizes, stop=stops,
                                         include_stop_str_in_output=include)
                full = tok.decode(ids)
                assert "".join(deltas) + tail == expected_with_stop(full, stops, include)


def test_random_stops_match_reference(tok):
    rng = random.Random(2)
    for _ in range(60):
        text = rng.choice(TEXTS)
        ids = tok.encode(text)
        stops = []
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randint(1, 6)] if rng.random() < 0.8 else "zq")
        include = rng.random() < 0.5
        sizes = [rng.randint(1, 3) for _ in ids]
        deltas, tail, _ = stream(tok, [], ids, sizes, stop=tuple(stops),
                                 include_stop_str_in_output=include)
        assert "".join(deltas) + tail == expected_with_stop(text, stops, include), stops
        assert all("\ufffd" not in d for d in deltas)


def test_bad_stop_strings_are_refused(tok):
    with pytest.raises(ValueError, match="stop strings must be non-empty"):
        IncrementalDetokenizer(tok, [], stop=("",))
