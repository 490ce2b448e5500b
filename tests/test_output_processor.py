"""The output processor alone (no model): every stop check and its precedence, text deltas
that add up to the whole text, stop strings held back and cut, logprobs as asked."""
from __future__ import annotations

import pytest

from loramux_engine.output_processor import OutputProcessor, token_stop
from loramux_engine.outputs import FinishReason
from loramux_engine.request import Request
from loramux_engine.scheduler import Sampled
from loramux_core.sampling import SamplingParams

EOS = 2


def request(prompt, **params) -> Request:
    return Request("r", list(prompt), SamplingParams(**params))


def after(req: Request, *tokens: int) -> Request:
    for t in tokens:
        req.append_token(t)
    return req


@pytest.mark.parametrize("params,tokens,max_model_len,want", [
    (dict(max_tokens=4), (5, 6), 100, None),
    (dict(max_tokens=2), (5, 6), 100, FinishReason.LENGTH),
    (dict(max_tokens=8), (5, 6), 5, FinishReason.LENGTH),             # the model's limit
    (dict(max_tokens=8), (5, EOS), 100, FinishReason.EOS),
    (dict(max_tokens=8, ignore_eos=True), (5, EOS), 100, None),
    (dict(max_tokens=8, stop_token_ids=(6,)), (5, 6), 100, FinishReason.STOP),
    (dict(max_tokens=2, stop_token_ids=(EOS,)), (5, EOS), 100, FinishReason.STOP),  # first
])
def test_token_stops_and_their_order(params, tokens, max_model_len, want):
    req = after(request([1, 3, 4], **params), *tokens)
    assert token_stop(req, frozenset({EOS}), max_model_len) == want


def test_deltas_add_up_and_a_stop_string_is_cut(tok):
    text = "the quick brown fox jumps over"
    ids = tok.encode(text, add_special_tokens=False)
    proc = OutputProcessor(tok, frozenset({EOS}), 1 << 20)
    req = request(tok.encode("say: "), max_tokens=64, stop=("fox",), logprobs=True)
    proc.add(req)
    deltas, reason = [], None
    for i, t in enumerate(ids):
        reason = proc.append(after(req, t), Sampled(t, -0.1 * i))
        out = proc.step_output(req)
        assert out.new_token_ids == [t] and out.new_logprobs == [pytest.approx(-0.1 * i)]
        deltas.append(out.text_delta)
        if reason is not None:
            break
    assert reason == FinishReason.STOP
    assert "".join(deltas) == proc.request_output(req).text == "the quick brown "
    assert proc.step_output(req, new_token=False).text_delta == ""   # nothing left over


def test_logprobs_only_when_asked_and_top_logprobs_kept(tok):
    proc = OutputProcessor(tok, frozenset({EOS}), 1 << 20)
    plain, top = request([1, 3], max_tokens=4), request([1, 3], max_tokens=4, top_logprobs=2)
    for req in (plain, top):
        proc.add(req)
        proc.append(after(req, 7), Sampled(7, -0.5, {7: -0.5, 8: -1.5}))
    assert proc.step_output(plain).new_logprobs == []
    assert proc.step_output(top).new_logprobs == [-0.5]
    assert proc.step_output(top).new_top_logprobs == [{7: -0.5, 8: -1.5}]
    assert proc.request_output(plain).logprobs == [-0.5]   # the whole result keeps them
