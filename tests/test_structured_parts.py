"""The constrained-decoding parts on their own, with llguidance and the tiny tokenizer: the
compiler (cache by text, refusals naming the field and the library's reason, a padded
vocabulary never allowed), the bitmask fill, and its application to logits against a
plain torch reference."""
import json
import threading

import pytest
import torch

from loramux_core.errors import InvalidRequestError
from loramux_core.structured import StructuredOutput
from loramux_engine.request import Request
from loramux_engine.sampling import Sampler, SamplingState
from loramux_engine.sampling.mask import apply_token_bitmask
from loramux_engine.structured import CompilerConfig, Constraint, GrammarCompiler
from loramux_engine.structured.masks import TokenMasks
from loramux_core.sampling import SamplingParams
from tests.support.tiny import EOS_ID, build_tokenizer

PADDED = 416  # logits wider than the tiny tokenizer's 384 ids (a model's padding rows)
SCHEMA = StructuredOutput("json_schema", json.dumps({
    "type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
    "additionalProperties": False}))


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok = build_tokenizer()
    tok.save(str(path))
    return tok, path


@pytest.fixture(scope="module")
def compiler(hf_tok):
    c = GrammarCompiler(CompilerConfig(hf_tok[1], PADDED, (EOS_ID,)))
    yield c
    c.close()


def allowed_ids(bitmask_row: torch.Tensor, vocab: int) -> list[int]:
    return [t for t in range(vocab) if (int(bitmask_row[t // 32]) >> (t % 32)) & 1]


def constrained(compiler, s: StructuredOutput, generated=()) -> Request:
    req = Request("r", [1, 2], SamplingParams(structured=s))
    req.grammar = Constraint(s, compiler.submit(s), timeout_s=60)
    req.grammar.wait(60)
    assert req.grammar.settle(list(generated))
    return req


def test_cache_compiles_a_text_once(compiler):
    assert compiler.submit(SCHEMA) is compiler.submit(StructuredOutput(SCHEMA.kind, SCHEMA.spec))
    assert compiler.submit(SCHEMA) is not compiler.submit(StructuredOutput("json_object"))


@pytest.mark.parametrize("kind,spec,reason", [
    ("json_schema", '{"type": "nonsense"}', "nonsense"),
    ("regex", "a(b", "unclosed group"),
    ("grammar", "start: foo", "unknown name"),
])
def test_refusal_names_the_field_and_the_reason(compiler, kind, spec, reason):
    fut = compiler.submit(StructuredOutput(kind, spec))
    exc = fut.exception(timeout=60)
    assert isinstance(exc, InvalidRequestError)
    assert str(exc).startswith(f"sampling.structured.{kind}: ") and reason in str(exc)


def test_mask_allows_the_grammar_then_only_eos_never_padding(compiler, hf_tok):
    tok, _ = hf_tok
    masks = TokenMasks(PADDED, max_rows=4, pin=False)
    free = Request("free", [1], SamplingParams())
    req = constrained(compiler, StructuredOutput("regex", "ab|cd"))
    rows, bitmask = masks.fill([free, req])
    assert rows == [1] and bitmask.shape == (1, PADDED // 32)
    first = allowed_ids(bitmask[0], PADDED)
    assert first and all(tok.id_to_token(t)[0] in "ac" for t in first)
    for t in tok.encode("cd").ids:
        req.grammar.accept(t)
        req.append_token(t)
    _, bitmask = masks.fill([req])
    assert allowed_ids(bitmask[0], PADDED) == [EOS_ID]


def test_choice_and_resumed_tokens(compiler, hf_tok):
    tok, _ = hf_tok
    s = StructuredOutput.choice_of(["red", "green"])
    req = constrained(compiler, s, generated=tok.encode("gr").ids)
    assert req.grammar.ready
    bad = Constraint(s, compiler.submit(s), timeout_s=60)
    bad.wait(60)
    assert bad.settle(tok.encode("blue").ids) and not bad.ready
    assert "generated_token_ids" in str(bad.error) and "sampling.structured.choice" in str(bad.error)


def test_a_compile_past_its_bound_fails_alone(compiler):
    gate = threading.Event()
    blockers = [compiler.pool.submit(gate.wait) for _ in range(compiler.cfg.threads)]
    try:
        s = StructuredOutput("regex", "x{1,7}")
        slow = Constraint(s, compiler.submit(s), timeout_s=0.0)
        assert slow.settle([]) and "not compiled within" in str(slow.error)
    finally:
        gate.set()
        for b in blockers:
            b.result()


def reference_mask(logits, rows, bitmask):
    out = logits.clone()
    for k, row in enumerate(rows):
        for t in range(logits.shape[1]):
            if t >= bitmask.shape[1] * 32 or not (int(bitmask[k, t // 32]) >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [40, 64, 100])
def test_apply_matches_reference(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 2), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)  # 64 ids: the model's rows past them are padding
    rows = [2, 0]
    want = reference_mask(logits, rows, bitmask)
    got = apply_token_bitmask(logits.clone(), torch.tensor(rows), bitmask)
    assert torch.equal(got, want)


def test_sampler_masks_and_keeps_raw_logprobs():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 64, generator=gen)
    bitmask = torch.zeros(1, 2, dtype=torch.int32)
    bitmask[0, 1] = 1 << 3  # only token 35
    states = [SamplingState.create(SamplingParams(temperature=t), [1], default_seed=5)
              for t in (0.0, 1.0)]
    for row in (0, 1):
        out = Sampler().sample(logits, states, (torch.tensor([row]), bitmask))
        assert out.token_ids[row] == 35
        assert out.logprobs[row] == pytest.approx(torch.log_softmax(logits[row], -1)[35].item())
        free = 1 - row
        assert out.token_ids[free] == Sampler().sample(logits, states).token_ids[free]
