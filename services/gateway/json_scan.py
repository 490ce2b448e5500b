"""Where a JSON object or array ends, found as its text arrives piece by piece.

The scanner keeps only its depth and whether it is inside a string (and after a
backslash there), so each character is looked at once however the text is cut: a parser
that waits for a call's object to close costs linear time in the output."""
from __future__ import annotations

import re

_OUTSIDE = re.compile(r'[{}\[\]"]')  # what changes the state outside a string
_INSIDE = re.compile(r'["\\]')       # ... and inside one


class JsonScanner:
    """Feed the text of one value, starting with its "{" or "["; feed() says where in the
    piece it got the value closed. It checks nesting only: the closed text still has to
    parse (a stray "]" in an object closes it early, and then it does not)."""

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in `text` just after the value's last character; None: not closed."""
        i = 0
        while i < len(text):
            if self.escaped:  # the character after a backslash never ends the string
                self.escaped, i = False, i + 1
                continue
            found = (_INSIDE if self.in_string else _OUTSIDE).search(text, i)
            if found is None:
                return None
            i, c = found.end(), found.group()
            if self.in_string:
                self.escaped, self.in_string = c == "\\", c == "\\"
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            else:
                self.depth -= 1
                if self.depth <= 0:
                    return i
        return None
