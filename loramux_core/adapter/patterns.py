"""The regexes of adapter_config.json, matched in linear time.

PEFT matches `target_modules` / `exclude_modules` given as a string with
`re.fullmatch(pattern, name)` and tries `rank_pattern` / `alpha_pattern` keys in order with
`re.match(rf"(.*\\.)?({key})$", name)`. Python's backtracking engine takes exponential time
on patterns like `(a+)+$`, and these patterns come from files the operator did not write.
Here the same expressions run on RE2, which has no backtracking: matching time is linear
in the name whatever the pattern. A pattern RE2 cannot express (backreferences,
lookaround) is refused with an AdapterError rather than run on a backtracking engine, and
a pattern Python's `re` rejects is refused too, as PEFT itself could not load it.

Module names contain no newline, so Python's `$` (which also matches before a final
newline) and RE2's `$` agree on every name this is used for.
"""
from __future__ import annotations

import re

import re2

from loramux_core.errors import AdapterError


MAX_PATTERN_CHARS = 16 << 10
MAX_PATTERN_KEYS = 1024     # rank_pattern / alpha_pattern entries
_MAX_MEM = 32 << 20         # RE2's memory budget per compiled pattern


def _options() -> re2.Options:
    opts = re2.Options()
    opts.log_errors = False
    opts.max_mem = _MAX_MEM
    return opts


class Pattern:
    """One compiled adapter_config pattern; `matches(name)` is PEFT's test for it."""

    def __init__(self, source: str, suffix_key: bool, field: str, file: str):
        if not isinstance(source, str):
            raise AdapterError(f"{field}: {source!r} is not a string", feature=field, file=file)
        if len(source) > MAX_PATTERN_CHARS:
            raise AdapterError(f"{field}: a pattern of {len(source)} characters is longer than "
                               f"the {MAX_PATTERN_CHARS} allowed", feature=field, file=file)
        self.source = source
        # rank/alpha keys: PEFT's re.match(rf"(.*\.)?({key})$") is a full match of this.
        full = rf"(?:.*\.)?(?:{source})" if suffix_key else source
        try:
            re.compile(full)
        except (re.error, RecursionError, OverflowError) as e:
            raise AdapterError(f"{field}: {_short(source)} is not a valid regex ({e})",
                               feature=field, file=file) from None
        try:
            self._re = re2.compile(full, _options())
        except re2.error as e:
            raise AdapterError(f"{field}: {_short(source)} cannot be matched in linear time "
                               f"(RE2: {_why(e)}); backreferences and lookaround are not "
                               "supported", feature=field, file=file) from None

    def matches(self, name: str) -> bool:
        return self._re.fullmatch(name) is not None


def _short(source: str) -> str:
    return repr(source if len(source) <= 200 else source[:200] + "...")


def _why(e: Exception) -> str:
    msg = e.args[0] if e.args else str(e)
    return msg.decode("utf-8", "replace") if isinstance(msg, bytes) else str(msg)


def check_key_count(n: int, field: str, file: str) -> None:
    if n > MAX_PATTERN_KEYS:
        raise AdapterError(f"{field} has {n} keys, more than the {MAX_PATTERN_KEYS} allowed",
                           feature=field, file=file)


def dotted_suffixes(name: str) -> set[str]:
    """`name` and every part of it after a `.`: the names `name.endswith("." + t)` or
    `name == t` accept, so a list of any length is matched with set look-ups."""
    out = {name}
    at = name.find(".")
    while at >= 0:
        out.add(name[at + 1:])
        at = name.find(".", at + 1)
    return out
