"""A request resumed with the tokens it already generated (Engine.add_request's
`generated`, what a gateway sends when the replica that ran it died): at every point it
can be cut, the resumed run sends exactly the rest of the first run's tokens and text
(a stop string straddling the cut included), finishes for the same reason at the same
token, counts the original prompt, and a seeded sampled request continues with the same
tokens. A bad resume is refused and disturbs nothing."""
import pytest

from loramux_engine import FinishReason, InvalidRequestError, SamplingParams
from tests.test_engine_parity import prompts_of
from tests.test_engine_requests import eng  # noqa: F401 - the same small engine, a fixture


def run(eng, rid, prompt, params, adapter, generated=()):
    """Every StepOutput of one request, run alone."""
    eng.add_request(rid, prompt, params, adapter, generated=list(generated))
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


def tokens_and_text(outs):
    return [t for o in outs for t in o.new_token_ids], "".join(o.text_delta for o in outs)


def sent_after(outs, k):
    """What the caller had after the first k tokens: the deltas up to the k-th token's."""
    tokens, seen = [], []
    for o in outs:
        if len(tokens) >= k:
            break
        tokens += o.new_token_ids
        seen.append(o)
    return tokens_and_text(seen)


def test_resumed_at_every_cut_continues_the_stream(eng):
    prompt = prompts_of([9], seed=31)[0]
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    full_text = tokens_and_text(run(eng, "free", prompt, free, "rs4"))[1]
    # a stop string of several tokens' text, so some cuts fall inside it
    mid = len(full_text) // 2
    stop = full_text[mid:mid + 5]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, stop=[stop])
    first = run(eng, "first", prompt, params, "rs4")
    tokens, text = tokens_and_text(first)
    assert first[-1].finish_reason == FinishReason.STOP and text == full_text[:mid]
    for k in range(1, len(tokens)):
        had_tokens, had_text = sent_after(first, k)
        rest = run(eng, f"resumed-{k}", prompt, params, "rs4", generated=had_tokens)
        more_tokens, more_text = tokens_and_text(rest)
        assert had_tokens + more_tokens == tokens, k
        assert had_text + more_text == text, (k, had_text, more_text)
        assert rest[-1].finish_reason == FinishReason.STOP, k
        assert rest[-1].num_prompt_tokens == len(prompt)


def test_resumed_request_keeps_max_tokens_and_seeded_sampling(eng):
    prompt = prompts_of([12], seed=32)[0]
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20,
                            ignore_eos=True)
    tokens, text = tokens_and_text(run(eng, "seeded", prompt, params, "ap8"))
    assert len(tokens) == 20
    for k in (1, 7, 19):
        rest = run(eng, f"seeded-{k}", prompt, params, "ap8", generated=tokens[:k])
        more, _ = tokens_and_text(rest)
        assert tokens[:k] + more == tokens, k
        assert rest[-1].finish_reason == FinishReason.LENGTH
    other = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=20,
                           ignore_eos=True)
    assert tokens_and_text(run(eng, "other-seed", prompt, other, "ap8"))[0] != tokens


@pytest.mark.parametrize("generated,params,msg", [
    ([5] * 8, SamplingParams(max_tokens=8), "fewer than max_tokens=8"),
    ([5, 999], SamplingParams(max_tokens=8), "generated token 1: 999"),
    ([5], SamplingParams(max_tokens=8, n=2), "only a single sequence"),
])
def test_bad_resume_is_refused(eng, generated, params, msg):
    free = eng.kv.num_free_blocks
    with pytest.raises(InvalidRequestError, match=msg):
        eng.add_request("bad-resume", [5, 6, 7], params, None, generated=generated)
    assert not eng.has_unfinished() and eng.kv.num_free_blocks == free
