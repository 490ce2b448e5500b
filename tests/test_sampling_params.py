"""SamplingParams.validate: each bad field gets an InvalidRequestError naming it."""
from __future__ import annotations

import pytest

from loramux_core.errors import InvalidRequestError
from loramux_core.sampling import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", 101.0),
    ("temperature", "hot"), ("top_p", 0.0), ("top_p", 1.5), ("top_p", float("nan")),
    ("top_k", -1), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", 11.0), ("max_tokens", 0),
    ("top_logprobs", 21), ("top_logprobs", -1), ("n", 0), ("n", 65), ("n", True),
    ("seed", -1), ("seed", 2**63), ("seed", "7"), ("stop", ("",)), ("stop", (3,)),
    ("stop_token_ids", (-1,)), ("stop_token_ids", ("a",)), ("logprobs", 1),
    ("ignore_eos", "yes"),
])
def test_bad_field_is_named(field, value):
    with pytest.raises(InvalidRequestError, match=rf"sampling\.{field}="):
        SamplingParams(**{field: value}).validate()


def test_stop_token_ids_checked_against_vocab():
    SamplingParams(stop_token_ids=[5]).validate(vocab_size=6)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids=\(6,\).*\[0, 6\)"):
        SamplingParams(stop_token_ids=[6]).validate(vocab_size=6)


def test_good_params_pass_and_lists_become_tuples():
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1, repetition_penalty=1.2,
                       seed=0, max_tokens=4, stop=["a"], stop_token_ids=[1], logprobs=True,
                       top_logprobs=20, n=2)
    p.validate(vocab_size=10)
    assert p.stop == ("a",) and p.stop_token_ids == (1,)
    assert p.greedy and not SamplingParams(temperature=0.5).greedy
    assert SamplingParams(temperature=1e-7).greedy  # too small to divide by
    hash(p)
