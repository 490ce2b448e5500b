"""Incremental detokenization with stop strings, for streaming generated text.

Text of new tokens is found by decoding a small window of recent tokens twice, with and
without the new ones, and taking the difference (the "prefix/read offset" technique):

    ids:   ... prompt tail ... | already emitted | not yet readable | new
                               ^prefix_offset    ^read_offset
    prefix_text = decode(ids[prefix_offset:read_offset])
    new_text    = decode(ids[prefix_offset:])        -> delta = new_text[len(prefix_text):]

Decoding in context keeps the spaces that byte-level BPE and SentencePiece put on token
boundaries. While the window ends inside a multi-byte character, `new_text` ends with
U+FFFD: nothing is emitted and the offsets stay, so the character comes out whole once its
last byte arrives. No torch here: the gateway uses this too.
"""
from __future__ import annotations

# Prompt tokens kept as decoding context for the first generated tokens.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns one request's generated ids, pushed a few at a time, into text deltas.

    With stop strings, generated text is cut at the first occurrence of any of them (the
    stop string itself kept only with include_stop_str_in_output), and text that might be
    the start of a stop string is held back until the next tokens tell. The deltas returned
    by push() and finish() concatenate to decode(generated ids) cut at the stop string.
    """

    def __init__(self, tokenizer, prompt_token_ids, skip_special_tokens: bool = True,
                 stop: tuple[str, ...] = (), include_stop_str_in_output: bool = False):
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop={stop!r}: stop strings must be non-empty strings")
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._stop = tuple(stop)
        self._include_stop = include_stop_str_in_output
        self._ids = list(prompt_token_ids)[-_PROMPT_CONTEXT:]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        # The text of the generated tokens decoded so far (cut at a stop) is _done + _tail,
        # kept in two parts so that it grows by work linear in its length: appending each
        # delta to one string would copy all of it per token. _tail, from character _base
        # on, is what stop strings still need: the held-back text and the emitted end a
        # stop string may begin in (_lookback characters); older text moves to _done.
        self._done: list[str] = []
        self._tail = ""
        self._base = 0
        self._lookback = max(map(len, self._stop), default=1) - 1
        self._emitted = 0    # how much of the text push()/finish() have returned
        self._stop_str: str | None = None
        self._finished = False

    @property
    def text(self) -> str:
        """All text returned so far."""
        return "".join(self._done) + self._tail[:self._emitted - self._base]

    @property
    def stop_hit(self) -> bool:
        """True once a stop string appeared in the generated text."""
        return self._stop_str is not None

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended generation, if any."""
        return self._stop_str

    def push(self, new_ids) -> str:
        """Add newly generated ids (a list, or one int); return the text they complete.

        Returns "" once a stop string was hit: check `stop_hit` after each push."""
        if self._finished:
            raise RuntimeError("push() after finish()")
        if self.stop_hit:
            return ""
        self._ids.extend([new_ids] if isinstance(new_ids, int) else new_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""  # nothing new, or a character still incomplete: wait for more bytes
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._advance(new_text[len(prefix_text):], final=False)

    def finish(self) -> str:
        """Flush everything held back and end the stream.

        After a stop string nothing more comes out. Otherwise the held-back tail is
        released: a possible stop-string prefix, and undecodable bytes (as U+FFFD, so
        nothing the model produced is silently lost)."""
        if self._finished:
            return ""
        self._finished = True
        if self.stop_hit:
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset, len(self._ids))
        return self._advance(new_text[len(prefix_text):], final=True)

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end],
                                      skip_special_tokens=self._skip_special)

    def _advance(self, delta: str, final: bool) -> str:
        """Append `delta`, cut at a stop string, and return what may be emitted now."""
        old_len = self._len()
        self._tail += delta
        if self._stop:
            cut = self._find_stop(old_len)
            if cut is not None:
                assert cut >= self._base, "a stop string is never cut out of retired text"
                self._tail = self._tail[:cut - self._base]
                final = True
        end = self._len() if final or self._include_stop else self._safe_end()
        out = self._tail[self._emitted - self._base:end - self._base]
        self._emitted = max(self._emitted, end)
        self._retire()
        return out

    def _len(self) -> int:
        return self._base + len(self._tail)

    def _retire(self) -> None:
        """Move emitted text that no stop string can reach back into from _tail to _done."""
        keep = min(self._emitted, self._len() - self._lookback) - self._base
        if keep > 0:
            self._done.append(self._tail[:keep])
            self._tail = self._tail[keep:]
            self._base += keep

    def _find_stop(self, old_len: int) -> int | None:
        """End of the kept text if a stop string occurs in text that grew past `old_len`,
        else None. The stop string completed first wins (the longest if several complete
        at the same character), as if text arrived one character at a time."""
        best: tuple[int, int, str] | None = None
        for s in self._stop:
            # An occurrence found now must end after old_len, else it was found before;
            # it starts within _lookback of old_len, so inside _tail.
            idx = self._tail.find(s, max(0, old_len - len(s) + 1 - self._base))
            if idx >= 0:
                idx += self._base
                if best is None or (idx + len(s), idx) < best[:2]:
                    best = (idx + len(s), idx, s)
        if best is None:
            return None
        end, idx, self._stop_str = best
        return end if self._include_stop else idx

    def _safe_end(self) -> int:
        """Where text stops being safe to emit: before the longest suffix of the text that
        is a proper prefix of some stop string (it may still grow into that stop string).
        _tail holds at least the last _lookback characters, all such a suffix can be."""
        text = self._tail
        hold = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return max(self._emitted, self._len() - hold)
