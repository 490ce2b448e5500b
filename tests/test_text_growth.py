"""Generated text grows by work linear in its length, token after token.

Appending each token's text to the whole text so far (`obj.text += delta`) copies the
whole text per token: O(n^2) characters for n tokens, seconds per request at tens of
thousands of tokens (CPython appends in place only to local variables, not attributes).
No timing here: the text comes in as a str subclass that counts the characters copied by
every concatenation and slice made of it, so a whole-text copy per token shows up as a
count of about n^2/2 where linear growth stays a few times n.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from loramux_engine.detokenizer import IncrementalDetokenizer
from loramux_engine.output_processor import OutputProcessor
from loramux_engine.request import Request
from loramux_engine.scheduler import Sampled
from loramux.client import Completion
from loramux_core.sampling import SamplingParams
from loramux_core.tokenizer import Tokenizer
from loramux_services.gateway.openai_responses import Choice

TEXT = "héllo wörld, ça va? 🙂🚀 the quick brown fox jumps over the lazy dog. " * 60


class CopyCounter:
    """Makes strings that add to `chars` the length of every string built from them by
    `+` or slicing (the copies a text accumulator makes)."""

    def __init__(self):
        self.chars = 0
        counter = self

        class Counted(str):
            def __add__(self, other):
                counter.chars += len(self) + len(other)
                return Counted(str.__add__(self, other))

            def __radd__(self, other):  # "" + Counted: str has no __add__ for a subclass
                counter.chars += len(other) + len(self)
                return Counted(str.__add__(other, self))

            def __getitem__(self, key):
                piece = str.__getitem__(self, key)
                counter.chars += len(piece)
                return Counted(piece)

        self.str = Counted


class CountingTokenizer:
    """The tiny tokenizer, whose decoded text counts the copies made of it."""

    def __init__(self, tok: Tokenizer, counter: CopyCounter):
        self._tok, self._counter = tok, counter

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._counter.str(self._tok.decode(ids, skip_special_tokens=skip_special_tokens))


@pytest.fixture(scope="module")
def ids(tok) -> list[int]:
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 1500 and len(TEXT) > 4000  # long enough for n^2 to stand out
    return ids


def linear_bound(ids, stop) -> int:
    """Characters a detokenizer may copy: a few times each token's own text, and per
    token the tail that a stop string could still begin in."""
    return 6 * (len(TEXT) + len(ids) * max(map(len, stop), default=0))


@pytest.mark.parametrize("stop", [(), ("lazy cat!", "🚀x")])
def test_detokenizer_copies_linear_in_the_text(tok, ids, stop):
    counter = CopyCounter()
    detok = IncrementalDetokenizer(CountingTokenizer(tok, counter), [], stop=stop)
    out = "".join([*(detok.push([t]) for t in ids), detok.finish()])
    copied = counter.chars
    assert out == detok.text == TEXT and not detok.stop_hit
    assert copied <= linear_bound(ids, stop), copied


def test_output_processor_copies_linear_in_the_text(tok, ids):
    counter = CopyCounter()
    proc = OutputProcessor(CountingTokenizer(tok, counter), frozenset({1}), 1 << 20)
    req = Request("r", [5, 6], SamplingParams(max_tokens=len(ids), stop=("lazy cat!",)))
    proc.add(req)
    deltas = []
    for t in ids:
        req.append_token(t)
        proc.append(req, Sampled(t, 0.0))
        deltas.append(proc.step_output(req).text_delta)
    assert "".join(deltas) == proc.request_output(req).text == TEXT
    assert counter.chars <= linear_bound(ids, ("lazy cat!",)), counter.chars


@pytest.mark.parametrize("accumulator", [lambda: Choice(0), Completion])
def test_response_accumulators_copy_linear_in_the_text(accumulator):
    counter = CopyCounter()
    acc = accumulator()
    pieces = [TEXT[i:i + 3] for i in range(0, len(TEXT), 3)]
    for piece in pieces:
        acc.add(SimpleNamespace(text=counter.str(piece), token_ids=[7], logprobs=[],
                                finish_reason=0))
    assert acc.text == TEXT and acc.token_ids == [7] * len(pieces)
    assert counter.chars <= 2 * len(TEXT), counter.chars
