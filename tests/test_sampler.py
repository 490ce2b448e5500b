"""The batched sampler against Hugging Face's logits processors (the oracle), and its
seeding, logprob and distribution contracts."""
from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper,
                                                    RepetitionPenaltyLogitsProcessor,
                                                    TemperatureLogitsWarper, TopKLogitsWarper,
                                                    TopPLogitsWarper)

from loramux_engine.sampling import RequestSeeds, Sampler, SamplingState
from loramux_engine.sampling.processors import apply_min_p, apply_top_k_top_p
from loramux_core.sampling import SamplingParams

VOCAB = 97


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=gen) * scale


def state(params: SamplingParams, prompt=(), seed: int = 123, output=()):
    s = SamplingState.create(params, list(prompt), default_seed=seed)
    for t in output:
        s.append(t)
    return s


def test_greedy_is_argmax():
    logits = random_logits(6)
    out = Sampler().sample(logits, [state(SamplingParams(temperature=0.0)) for _ in range(6)])
    assert out.token_ids == logits.argmax(-1).tolist()


def test_greedy_with_repetition_penalty_matches_hf():
    logits = random_logits(5, seed=1)
    logits[4] -= 20.0  # all negative: seen logits must be multiplied, not divided
    ranked = logits.argsort(-1, descending=True).tolist()
    # Histories hold highly ranked ids (with a repeat) so the penalty flips the argmax;
    # a penalty < 1 boosts, so that row's history holds runners-up.
    histories = [[ranked[0][0], ranked[0][2], ranked[0][0], 90],
                 [ranked[1][1], ranked[1][3], 0],
                 [ranked[2][0], ranked[2][1]],
                 [ranked[3][0], 8, 9, 10, ranked[3][5], 12, 13],
                 [ranked[4][0], ranked[4][3]]]
    penalties = [1.7, 0.6, 1.3, 2.5, 1.2]
    states = [state(SamplingParams(temperature=0.0, repetition_penalty=pen),
                    prompt=hist[:2], output=hist[2:])  # seen ids from prompt and output
              for hist, pen in zip(histories, penalties)]
    out = Sampler().sample(logits, states)
    expected = []
    for i, (hist, pen) in enumerate(zip(histories, penalties)):
        row = RepetitionPenaltyLogitsProcessor(pen)(torch.tensor([hist]), logits[i:i + 1].clone())
        expected.append(int(row.argmax(-1)))
    assert out.token_ids == expected
    # The penalty must matter here, else the test proves nothing.
    changed = sum(e != r[0] for e, r in zip(expected, ranked))
    assert changed >= 4, (expected, [r[0] for r in ranked])


def test_penalty_changes_greedy_choice_of_repeated_token():
    logits = torch.full((1, 8), -1.0)
    logits[0, 3], logits[0, 4] = 2.0, 1.5
    plain = Sampler().sample(logits, [state(SamplingParams(temperature=0.0), output=[3])])
    penal = Sampler().sample(logits, [state(SamplingParams(temperature=0.0,
                                                           repetition_penalty=2.0), output=[3])])
    assert plain.token_ids == [3] and penal.token_ids == [4]


def hf_mask(logits, *warpers):
    x = logits.clone()
    for w in warpers:
        x = w(None, x)
    return torch.isinf(x)


@pytest.mark.parametrize("k", [1, 5, 40, VOCAB, VOCAB + 10])
def test_top_k_mask_matches_hf(k):
    logits = random_logits(5, seed=k)
    ks = torch.full((5,), min(k, VOCAB))
    ours = apply_top_k_top_p(logits, ks, torch.ones(5))
    assert torch.equal(torch.isinf(ours), hf_mask(logits, TopKLogitsWarper(k)))


@pytest.mark.parametrize("p", [0.05, 0.3, 0.75, 0.95])
def test_top_p_mask_matches_hf(p):
    logits = random_logits(5, seed=int(p * 100))
    ours = apply_top_k_top_p(logits, torch.full((5,), VOCAB), torch.full((5,), p))
    expected = hf_mask(logits, TopPLogitsWarper(p))
    assert torch.equal(torch.isinf(ours), expected)
    assert 0 < int(expected.sum()) < expected.numel()  # a real cut, not all or nothing


def test_top_k_then_top_p_per_row_matches_hf():
    logits = random_logits(4, seed=9)
    ks, ps = [3, 20, VOCAB, 50], [0.9, 0.5, 0.8, 1.0]
    ours = apply_top_k_top_p(logits, torch.tensor(ks), torch.tensor(ps))
    for i, (k, p) in enumerate(zip(ks, ps)):
        warpers = [TopKLogitsWarper(k)] + ([TopPLogitsWarper(p)] if p < 1.0 else [])
        assert torch.equal(torch.isinf(ours[i:i + 1]), hf_mask(logits[i:i + 1], *warpers))


@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5])
def test_min_p_mask_matches_hf(min_p):
    logits = random_logits(5, seed=3)
    ours = apply_min_p(logits, torch.full((5,), min_p))
    expected = hf_mask(logits, MinPLogitsWarper(min_p))
    assert torch.equal(torch.isinf(ours), expected)
    assert 0 < int(expected.sum()) < expected.numel()


def allowed_set(logits_row, params: SamplingParams, history=()):
    """HF's pipeline in HF's order; the tokens left finite are the allowed ones."""
    x = logits_row[None].clone()
    if params.repetition_penalty != 1.0 and history:
        x = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)(torch.tensor([history]), x)
    x = TemperatureLogitsWarper(params.temperature)(None, x)
    if params.top_k:
        x = TopKLogitsWarper(params.top_k)(None, x)
    if params.top_p < 1.0:
        x = TopPLogitsWarper(params.top_p)(None, x)
    if params.min_p > 0.0:
        x = MinPLogitsWarper(params.min_p)(None, x)
    return set(torch.nonzero(torch.isfinite(x[0])).flatten().tolist())


def test_sampled_tokens_stay_in_hf_allowed_set():
    logits = random_logits(3, seed=11, scale=2.0)
    params = [SamplingParams(temperature=0.8, top_k=6),
              SamplingParams(temperature=1.3, top_p=0.6, repetition_penalty=1.5),
              SamplingParams(temperature=1.0, top_k=30, top_p=0.9, min_p=0.2)]
    history = [5, 6, 7]
    allowed = [allowed_set(logits[i], p, history) for i, p in enumerate(params)]
    seen = [set() for _ in params]
    states = [state(p, prompt=history, seed=100 + i) for i, p in enumerate(params)]
    sampler = Sampler()
    for _ in range(300):
        out = sampler.sample(logits, states)
        for i, (s, t) in enumerate(zip(states, out.token_ids)):
            assert t in allowed[i]
            seen[i].add(t)
            s.append(history[0])  # next step, same seen ids: the allowed set holds
    for i in range(3):
        assert len(seen[i]) > 1  # it does sample, not always the argmax


def test_empirical_distribution_matches_softmax():
    vocab, draws, temp = 6, 6000, 0.7
    logits = torch.tensor([[1.0, 0.3, -0.5, 2.0, 0.0, -2.0]])
    s = state(SamplingParams(temperature=temp), seed=2024)
    sampler = Sampler()
    counts = torch.zeros(vocab)
    for _ in range(draws):
        t = sampler.sample(logits, [s]).token_ids[0]
        counts[t] += 1
        s.append(t)
    expected = torch.softmax(logits[0] / temp, -1) * draws
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 25.0, (counts, expected)  # 5 dof: p < 1e-4 of failing by chance, seeded


def test_temperature_scales_logits_before_sampling():
    # With a very low temperature, sampling is practically greedy; with a high one, not.
    logits = random_logits(1, seed=5, scale=1.0)
    cold = state(SamplingParams(temperature=0.01), seed=1)
    hot = state(SamplingParams(temperature=50.0), seed=1)
    sampler, cold_ids, hot_ids = Sampler(), set(), set()
    for _ in range(100):
        cold_ids.add(sampler.sample(logits, [cold]).token_ids[0])
        hot_ids.add(sampler.sample(logits, [hot]).token_ids[0])
        cold.append(0)
        hot.append(0)
    assert cold_ids == {int(logits.argmax())}
    assert len(hot_ids) > 30


def run_steps(states_and_rows, steps, batch_logits_fn):
    sampler = Sampler()
    tokens = [[] for _ in states_and_rows]
    for step in range(steps):
        states = [s for s, _ in states_and_rows]
        logits = batch_logits_fn(step, [r for _, r in states_and_rows])
        out = sampler.sample(logits, states)
        for i, (s, t) in enumerate(zip(states, out.token_ids)):
            tokens[i].append(t)
            s.append(t)
    return tokens


def logits_for(step: int, row_keys) -> torch.Tensor:
    """The logits a request sees at a step depend only on the request key and step."""
    return torch.stack([random_logits(1, seed=1000 * key + step, scale=1.0)[0]
                        for key in row_keys])


def test_same_seed_same_tokens_whatever_the_batch():
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=77)
    alone = run_steps([(state(p), 0)], 12, logits_for)[0]
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.2, top_k=10),
              SamplingParams(temperature=0.9, min_p=0.1, seed=5)]
    crowd = [(state(o, seed=i), i + 1) for i, o in enumerate(others)]
    mixed = run_steps(crowd[:1] + [(state(p), 0)] + crowd[1:], 12, logits_for)[1]
    last = run_steps(crowd[::-1] + [(state(p), 0)], 12, logits_for)[3]
    assert alone == mixed == last
    assert len(set(alone)) > 1


def test_different_seeds_differ_and_steps_draw_fresh_noise():
    logits = lambda step, keys: random_logits(1, seed=0, scale=0.5).expand(len(keys), -1)
    a = run_steps([(state(SamplingParams(temperature=1.0, seed=1)), 0)], 20, logits)[0]
    b = run_steps([(state(SamplingParams(temperature=1.0, seed=2)), 0)], 20, logits)[0]
    assert a != b
    assert len(set(a)) > 3  # same logits every step, yet the tokens vary


def test_unseeded_requests_get_distinct_reproducible_seeds():
    first, second = RequestSeeds(0), RequestSeeds(0)
    seeds = [first.next() for _ in range(5)]
    assert seeds == [second.next() for _ in range(5)]
    assert len(set(seeds)) == 5
    assert RequestSeeds(1).next() not in seeds
    # An explicit seed wins over the default one.
    assert SamplingState.create(SamplingParams(seed=9), [], default_seed=4).seed == 9


def test_sample_index_separates_forks():
    p = SamplingParams(temperature=1.0, seed=3)
    logits = random_logits(1, seed=8, scale=0.5).expand(2, -1).contiguous()
    forks = [SamplingState.create(p, [1], default_seed=0, sample_index=i) for i in range(2)]
    sampler, toks = Sampler(), [[], []]
    for _ in range(10):
        out = sampler.sample(logits, forks)
        for i, t in enumerate(out.token_ids):
            toks[i].append(t)
            forks[i].append(t)
    assert toks[0] != toks[1]


def test_logprobs_come_from_raw_logits():
    logits = random_logits(3, seed=21)
    params = [SamplingParams(temperature=0.0, repetition_penalty=3.0, top_logprobs=5),
              SamplingParams(temperature=0.5, top_k=3, top_logprobs=2),
              SamplingParams(temperature=1.0)]
    out = Sampler().sample(logits, [state(p, prompt=[1, 2, 3]) for p in params])
    ref = torch.log_softmax(logits, -1)
    for i, t in enumerate(out.token_ids):
        assert math.isclose(out.logprobs[i], float(ref[i, t]), rel_tol=0, abs_tol=1e-6)
    assert out.top_logprobs[2] is None
    for i, k in ((0, 5), (1, 2)):
        top = out.top_logprobs[i]
        values, ids = ref[i].topk(k)
        assert list(top) == ids.tolist()
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert torch.allclose(torch.tensor(list(top.values())), values, atol=1e-6)


def test_bad_logits_shape_is_refused():
    with pytest.raises(ValueError, match="len\\(states\\)=2"):
        Sampler().sample(random_logits(3), [state(SamplingParams()), state(SamplingParams())])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_contracts():
    dev = torch.device("cuda")
    vocab = 32000
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05, seed=4),
              SamplingParams(temperature=1.1, seed=8, top_logprobs=3)]
    rows = [random_logits(1, vocab, seed=50 + i)[0] for i in range(3)]

    def run(order):
        states = [state(params[i], prompt=[1, 2, 3], seed=i) for i in order]
        toks = {i: [] for i in order}
        for _ in range(8):
            logits = torch.stack([rows[i] for i in order]).to(dev)
            out = Sampler().sample(logits, states)
            for i, s, t in zip(order, states, out.token_ids):
                toks[i].append(t)
                s.append(t)
        return toks, out

    a, out = run([0, 1, 2])
    b, _ = run([2, 1])
    assert a[1] == b[1] and a[2] == b[2]
    allowed = allowed_set(rows[1], params[1], [1, 2, 3] + a[1][:-1])
    assert a[1][-1] in allowed
    assert list(out.top_logprobs[2]) == torch.log_softmax(rows[2], -1).topk(3).indices.tolist()


def test_token_at_a_position_depends_only_on_seed_position_and_logits():
    """A request resumed at position p (its history given, not sampled here) draws what
    the one that sampled its way to p draws, from the same logits, anywhere in a batch."""
    p = SamplingParams(temperature=1.0, seed=99)
    logits = random_logits(1, seed=3, scale=0.5)
    there = state(p, prompt=[1, 2])
    for _ in range(6):
        there.append(Sampler().sample(random_logits(1, seed=9), [there]).token_ids[0])
    resumed = state(p, prompt=[7], output=[0] * 6)
    other = state(SamplingParams(temperature=0.7), seed=5)
    batch = torch.cat([random_logits(1, seed=4), logits])
    assert Sampler().sample(logits, [there]).token_ids == \
        Sampler().sample(batch, [other, resumed]).token_ids[1:]
    at = lambda seed, pos: Sampler().sample(
        logits, [state(SamplingParams(temperature=1.0, seed=seed), output=[0] * pos)]).token_ids[0]
    assert [at(99, pos) for pos in range(30)] != [at(100, pos) for pos in range(30)]
    assert len({at(99, pos) for pos in range(30)}) > 3  # each position draws afresh


def _noise_reference(key: int, column: int) -> float:
    """gumbel_noise's value for one (key, token id), in Python integers and floats."""
    mask = (1 << 64) - 1
    x = (key + (column + 1) * 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    x ^= x >> 31
    return -math.log(-math.log(((x >> 41) + 0.5) / 2**23))


def test_counter_noise_matches_its_reference_and_is_gumbel():
    from loramux_engine.sampling.noise import gumbel_noise

    gen = torch.Generator().manual_seed(6)
    keys = [0, 2**63 - 1, 2**63, 2**64 - 1] + torch.randint(0, 2**62, (4,), generator=gen).tolist()
    noise = gumbel_noise(keys, 300, torch.device("cpu"))
    for i, key in enumerate(keys):
        for v in (0, 1, 150, 299):
            assert noise[i, v].item() == pytest.approx(_noise_reference(key, v), abs=1e-5)
    assert gumbel_noise(keys[::-1], 300, torch.device("cpu")).flip(0).equal(noise)
    big = gumbel_noise(list(range(1000)), 1000, torch.device("cpu"))
    assert big.isfinite().all()
    assert big.mean().item() == pytest.approx(0.5772, abs=0.01)  # Euler-Mascheroni
    assert big.std().item() == pytest.approx(math.pi / math.sqrt(6), abs=0.01)
