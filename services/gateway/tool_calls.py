"""The tool calls a model writes in its own format, parsed out of its text as it streams.

Every format read here is a run of JSON objects `{"name": ..., "arguments" | "parameters":
{...}}` between a few literal markers, or (newer Mistral) a name, then the object of its
arguments:

  llama3_json  {"name": "f", "parameters": {...}}; {...}    only at the start of the output,
                                                           optionally after <|python_tag|>
  hermes       text <tool_call>{...}</tool_call>\\n<tool_call>{...}</tool_call> text
  mistral      text [TOOL_CALLS][{...}, {...}]              tokenizers before v11
               text [TOOL_CALLS]f[ARGS]{...}[TOOL_CALLS]g[ARGS]{...}   v11 and later, where
                                                           [CALL_ID]id may follow the name
  required     [{"name": ..., "parameters": {...}}, ...]   what tool_choice "required"
                                                           constrains the output to

`CallParser` is fed the text piece by piece and gives back content and whole calls as soon
as each is known, holding back only what may still turn out to be part of a call, so where
the pieces are cut never changes the result; the non-streamed response is the same parser
fed the whole text. Objects are scanned incrementally (JsonScanner): linear time in the
output. Text that breaks the format is content; calls completed before it stay calls."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from loramux_services.gateway.json_scan import JsonScanner

_WS = " \t\r\n"
_WORD = re.compile(r"[\w.\-]*")  # a function's name, or the id a model gives its call
# longer is no name (OpenAI caps them at 64); the cap also bounds the text held meanwhile
_WORD_MAX = 64


@dataclass(frozen=True)
class CallFormat:
    """`marker` opens the calls: anywhere in the text (`anywhere`), or only at its start,
    where it may be left out (llama3's <|python_tag|>). `open` comes before the first
    object ("[" for a list); after each object `after` (hermes closes each call), then
    `sep` leads to another object and `close` (or, for a format that may follow text,
    anything else) ends the calls. With `args`, the marker may instead be followed by a
    function's name, optionally `call_id` and an id, then `args` and the object of the
    arguments: one call per marker."""
    name: str
    marker: str
    anywhere: bool
    open: str = ""
    after: str = ""
    sep: str = ","
    close: str = "]"
    args: str = ""
    call_id: str = ""


FORMATS = {
    "llama3_json": CallFormat("llama3_json", "<|python_tag|>", anywhere=False, sep=";",
                              close=""),
    "hermes": CallFormat("hermes", "<tool_call>", anywhere=True, after="</tool_call>",
                         sep="<tool_call>", close=""),
    "mistral": CallFormat("mistral", "[TOOL_CALLS]", anywhere=True, open="[", args="[ARGS]",
                          call_id="[CALL_ID]"),
}
REQUIRED = CallFormat("required", "", anywhere=False, open="[")
PARSER_NAMES = ("auto", "none", *FORMATS)
# what each format's chat template shows its model; the first found wins
_TEMPLATE_MARKS = (("<tool_call>", "hermes"), ("[TOOL_CALLS]", "mistral"),
                   ("<|python_tag|>", "llama3_json"),
                   ("respond with a JSON for a function call", "llama3_json"))


def detect_format(template_source: str | None) -> CallFormat | None:
    """The call format a chat template teaches its model; None: none known here."""
    for mark, name in _TEMPLATE_MARKS:
        if template_source and mark in template_source:
            return FORMATS[name]
    return None


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text

    def openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def call_of(text: str, name: str | None = None) -> ToolCall | None:
    """The call a JSON object's text stands for, or, given the function's `name`, the call
    of those arguments; None when it is not one."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if name is not None:
        obj = {"name": name, "arguments": obj}
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], json.dumps(args, ensure_ascii=False))


def _held(text: str, literal: str) -> int:
    """Length of the longest end of `text` that begins `literal` (may yet become it)."""
    for k in range(min(len(text), len(literal) - 1), 0, -1):
        if literal.startswith(text[-k:]):
            return k
    return 0


class CallParser:
    """feed() each piece of text, then finish(); each gives (content, calls) newly known.

    `buf` is text not decided yet; `since` the pieces taken since the current call began
    (its marker, separators, the object so far): content again if the call breaks. Pieces,
    not one string: appending to a long string would copy it each time."""

    def __init__(self, fmt: CallFormat):
        self.fmt = fmt
        self.state = "seek" if fmt.anywhere else "lead"
        self.buf = ""
        self.since: list[str] = []
        self.scanner = JsonScanner()
        self.start = 0        # the piece of `since` the object being scanned begins with
        self.name: str | None = None  # the call's name, when it came before its arguments
        self._out: list[str] = []
        self._calls: list[ToolCall] = []

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self.buf += text
        while getattr(self, f"_{self.state}")():
            pass
        content, calls = "".join(self._out), self._calls
        self._out, self._calls = [], []
        return content, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        content, calls = self.feed("")
        if self.state in ("after", "between", "ended"):  # calls ended with the output
            content += self.buf.strip(_WS)
        else:  # plain text, or a call cut off before it was whole
            content += "".join(self.since) + self.buf
        self.buf, self.since = "", []
        return content, calls

    def _take(self, n: int, state: str) -> bool:
        """Move the first n characters of buf into the current call; go to `state`."""
        self.since.append(self.buf[:n])
        self.buf, self.state = self.buf[n:], state
        return True

    def _ws(self) -> int:
        return len(self.buf) - len(self.buf.lstrip(_WS))

    def _expect(self, literal: str, state: str) -> bool | None:
        """After whitespace: `literal` taken (True), not there yet (False), or not
        coming (None)."""
        skip = self._ws()
        text = self.buf[skip:]
        if text.startswith(literal):
            return self._take(skip + len(literal), state)
        return False if literal.startswith(text) else None

    # ---- states: each returns True while it changed something -----------------------

    def _seek(self) -> bool:
        at = self.buf.find(self.fmt.marker)
        if at < 0:
            cut = len(self.buf) - _held(self.buf, self.fmt.marker)
            self._out.append(self.buf[:cut])
            self.buf = self.buf[cut:]
            return False
        self._out.append(self.buf[:at])
        self.buf = self.buf[at:]
        return self._take(len(self.fmt.marker), "open")

    def _lead(self) -> bool:
        if not self.fmt.marker:
            return self._enter("open")
        if not self.buf.strip(_WS):
            return False
        found = self._expect(self.fmt.marker, "open")
        return found if found is not None else self._enter("open")  # the marker is optional

    def _enter(self, state: str) -> bool:
        self.state = state
        return True

    def _open(self) -> bool:
        self.name = None
        if not self.fmt.open:
            return self._enter("brace")
        found = self._expect(self.fmt.open, "brace")
        if found is None and self.fmt.args:  # the newer form: name[ARGS]{arguments}
            return self._take(self._ws(), "name")
        return found if found is not None else self._break()

    def _name(self) -> bool:
        return self._word({self.fmt.args: "brace", self.fmt.call_id: "call_id"}, keep=True)

    def _call_id(self) -> bool:
        """The model's own id for the call is dropped: ids come from new_call_id()."""
        return self._word({self.fmt.args: "brace"}, keep=False)

    def _word(self, then: dict[str, str], keep: bool) -> bool:
        """A word (kept as the call's name when `keep`), then one of the literals `then`
        maps to the state that follows it."""
        n = _WORD.match(self.buf).end()
        rest = self.buf[n:]
        if n > _WORD_MAX:
            return self._break()
        for literal, state in then.items():
            if literal and rest.startswith(literal):
                if keep:
                    self.name = self.buf[:n]
                return self._take(n + len(literal), state)
        if any(literal.startswith(rest) for literal in then):
            return False
        return self._break()

    def _brace(self) -> bool:
        skip = self._ws()
        if skip == len(self.buf):
            return False
        if self.buf[skip] != "{":
            return self._break()
        self._take(skip, "object")
        self.scanner = JsonScanner()
        self.start = len(self.since)
        return True

    def _object(self) -> bool:
        end = self.scanner.feed(self.buf)
        if end is None:
            self._take(len(self.buf), "object")
            return False
        self._take(end, "after" if self.name is None else "ended")
        call = call_of("".join(self.since[self.start:]), self.name)
        if call is None:
            return self._break()
        self._calls.append(call)
        self.since = []
        return True

    def _after(self) -> bool:
        if not self.fmt.after:
            return self._enter("between")
        found = self._expect(self.fmt.after, "between")
        return found if found is not None else self._end_calls()

    def _between(self) -> bool:
        if not self.buf.strip(_WS):
            return False
        for literal, state in ((self.fmt.sep, "brace"), (self.fmt.close, "ended")):
            if literal:
                found = self._expect(literal, state)
                if found:
                    self.since = [literal]  # content again if what follows breaks
                    return True
                if found is False:
                    return False
        return self._end_calls()

    def _ended(self) -> bool:
        """The format's close (or a call of the newer form) was taken: what follows (past
        whitespace) is text, or the marker of another call."""
        return bool(self.buf.strip(_WS)) and self._end_calls()

    def _end_calls(self) -> bool:
        """Text after the calls: a format that may follow text looks for its marker again;
        one that must start the output has no more calls."""
        self.since = []
        self.buf = self.buf.lstrip(_WS)
        return self._enter("seek" if self.fmt.anywhere else "text")

    def _break(self) -> bool:
        """The call broke its format: what it took is content, and the search goes on
        after it (or, for a format that must start the output, all the rest is text)."""
        self._out.extend(self.since)
        self.since = []
        return self._enter("seek" if self.fmt.anywhere else "text")

    def _text(self) -> bool:
        self._out.append(self.buf)
        self.buf = ""
        return False


def parse_all(fmt: CallFormat, text: str) -> tuple[str, list[ToolCall]]:
    """The content and the calls of a whole output."""
    parser = CallParser(fmt)
    content, calls = parser.feed(text)
    more, late = parser.finish()
    return content + more, calls + late
