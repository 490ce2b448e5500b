"""Grammar compiles off the step thread, cached by the constraint's text.

The grammar library is llguidance: it builds its token trie from the model's
tokenizer.json alone (no transformers), compiles JSON schemas, regexes and Lark grammars
in milliseconds, and fills a batch of token masks on its own threads with the GIL
released. A compile yields a pristine matcher (never advanced); every constrained
sequence gets a deep copy of it (engine/structured/constraint.py).

`submit(structured)` returns a Future at once: the compile runs on a small thread pool
(llguidance releases the GIL while it builds a grammar), so a slow schema delays only
the requests that wait for it. The cache is an LRU of those futures keyed by
(kind, spec): the same schema asked by many requests, or while its compile is still
running, is compiled once. A refusal is cached too: a hostile schema sent again fails at
once. The library's own limits (LLParserLimits) bound a compile's work; the engine adds a
wall-clock bound on how long a request waits for it (Constraint.settle).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import llguidance as llg

from loramux_core.errors import InvalidRequestError
from loramux_core.structured import JSON_OPTIONS, StructuredOutput

_ANY_OBJECT = '{"type": "object"}'
_MAX_REASON = 1000  # characters of the library's message an error carries
# the library's default bounds on a compile's and a step's work; its errors without the
# generated text (an error is the request's own, and says why, not what was written)
_LIMITS = llg.LLParserLimits(verbose_errors=False)


@dataclass(frozen=True)
class CompilerConfig:
    tokenizer_json: Path    # the model's tokenizer.json (what llguidance's trie is made of)
    vocab_size: int         # bitmask width in tokens: max(model logits width, tokenizer's)
    eos_token_ids: tuple[int, ...]   # allowed (only) once a document is complete
    threads: int = 2        # compiles at once
    cache_size: int = 512   # distinct constraints kept compiled


def grammar_text(s: StructuredOutput) -> str:
    """The llguidance grammar of a constraint (the whole output must match it)."""
    if s.kind == "json_schema":
        return llg.LLMatcher.grammar_from_json_schema(s.spec, defaults=JSON_OPTIONS)
    if s.kind == "json_object":
        return llg.LLMatcher.grammar_from_json_schema(_ANY_OBJECT, defaults=JSON_OPTIONS)
    # regex: the whole output; choice: one of the literal strings; grammar: Lark or GBNF
    return llg.grammar_from(s.kind, s.spec)


def refusal(s: StructuredOutput, reason: str) -> InvalidRequestError:
    """The request's error for a constraint the library refuses, naming the field."""
    reason = reason.strip()
    if len(reason) > _MAX_REASON:
        reason = reason[:_MAX_REASON] + " ..."
    return InvalidRequestError(f"sampling.structured.{s.kind}: {reason}")


class GrammarCompiler:
    """Compiles constraints on `threads` worker threads; one per engine."""

    def __init__(self, cfg: CompilerConfig):
        self.cfg = cfg
        self.pool = ThreadPoolExecutor(cfg.threads, thread_name_prefix="loramux-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._tokenizer: llg.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        # built now, while the engine starts: the build holds the GIL (about a second for a
        # 128k vocabulary), which would stall every stream at the first constrained request
        self.pool.submit(self.tokenizer)

    def submit(self, s: StructuredOutput) -> Future:
        """The compile of `s` (a pristine llguidance.LLMatcher, or InvalidRequestError),
        started now unless cached. Step thread only (the cache has no lock)."""
        fut = self._cache.get(s.key)
        if fut is not None:
            self._cache.move_to_end(s.key)
            return fut
        fut = self.pool.submit(self._compile, s)
        self._cache[s.key] = fut
        if len(self._cache) > self.cfg.cache_size:
            self._cache.popitem(last=False)
        return fut

    def tokenizer(self) -> llg.LLTokenizer:
        """llguidance's view of the vocabulary (built once, on a compile thread)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                c = self.cfg
                self._tokenizer = llg.LLTokenizer(c.tokenizer_json.read_text(),
                                                  n_vocab=c.vocab_size,
                                                  eos_token=list(c.eos_token_ids))
            return self._tokenizer

    def _compile(self, s: StructuredOutput) -> llg.LLMatcher:
        try:
            grammar = grammar_text(s)
        except (ValueError, RuntimeError) as e:  # e.g. a GBNF the converter cannot read
            raise refusal(s, str(e)) from None
        matcher = llg.LLMatcher(self.tokenizer(), grammar, log_level=0, limits=_LIMITS)
        if matcher.is_error():
            raise refusal(s, matcher.get_error())
        return matcher

    def close(self) -> None:
        """Stop taking compiles; one already running ends on its thread (bounded by the
        library's limits) without anyone waiting for it."""
        self.pool.shutdown(wait=False, cancel_futures=True)

