"""The grammar that holds tool_choice "auto" to the tools when one of them is `strict`
(as SGLang's structural tags do): the model writes what it likes, text or calls, but every
call it writes in its own format (tool_calls.py) names one of the tools and carries
arguments valid under that tool's `parameters` (any JSON object for a tool that is not
strict), so each call the parser finds parses and validates. The text around the calls may
not spell a call's marker out: what the parser would take for a call is always one.

It is a Lark grammar in llguidance's syntax (the engine compiles it as any `grammar`
constraint): free text is a lexeme that excludes the marker (`&` and `~` on regexes), a
marker the tokenizer has as a special token is that token (`<[id]>`), and each call's
JSON is `%json` of its schema, written as the engine writes JSON (JSON_OPTIONS)."""
from __future__ import annotations

import json

from loramux_core.structured import JSON_OPTIONS

from loramux_services.gateway.errors import BadParam
from loramux_services.gateway.tool_calls import CallFormat

_WS = r"/[ \t\r\n]{1,4}/"  # where a format allows whitespace: a little, never a flood


def call_grammar(fmt: CallFormat, calls: list[tuple[str, dict]], parallel: bool,
                 vocab) -> str:
    """The grammar of an output under `fmt` whose calls are `calls`, (name, parameters
    schema) each; one call at most unless `parallel`. `vocab`: the model's tokenizer
    (`token_to_id`, `is_special`), which says whether a marker is one special token and
    which Mistral form (a list, or name[ARGS]{...}) the model writes."""
    key = "parameters" if fmt.name == "llama3_json" else "arguments"
    rules = {}
    if fmt.name == "llama3_json":
        rules["ws"] = _WS
        lead = _re(fmt.marker)
        rules["TEXT"] = rf"/(?s:.*)/ & ~/(?s:[ \t\r\n]*(\{{|{lead}).*)/"
        rules["call"] = _json(_one_call(calls, key))
        more = ' (";" ws? call)*' if parallel else ""
        rules["start"] = f"TEXT | {_mark(fmt.marker, vocab)}? ws? call{more}"
        return _lark(rules)
    if fmt.args and vocab.token_to_id(fmt.args) is not None:  # Mistral: name[ARGS]{...}
        rules["body"] = " | ".join(f"{json.dumps(name)} {_mark(fmt.args, vocab)} args{i}"
                                   for i, (name, _) in enumerate(calls))
        rules.update((f"args{i}", _json(params)) for i, (_, params) in enumerate(calls))
    elif fmt.open == "[":  # Mistral: [TOOL_CALLS][{...}, {...}]
        rules["body"] = _json(call_list(calls, key, parallel))
    else:  # Hermes: <tool_call>{...}</tool_call>
        rules.update(ws=_WS, call=_json(_one_call(calls, key)))
        rules["body"] = f"ws? call ws? {json.dumps(fmt.after)}"
    repeat = "*" if parallel else "?"
    special = _special_id(fmt.marker, vocab)
    if special is None:  # the marker is text
        return _lark(triggered(rules, [fmt.marker], ["body"], repeat))
    rules["TAIL"] = _text_without([fmt.marker])  # not spelled out either
    rules["start"] = f"TAIL (<[{special}]> body TAIL){repeat}"
    return _lark(rules)


def tag_grammar(structures: list[tuple[str, dict, str]], triggers: list[str]) -> str:
    """vLLM's and SGLang's structural tag: free text, in which each trigger (the first
    found) must go on as one of the structures (begin, JSON schema, end) whose `begin`
    starts with it, then free text again. The caller checks that every begin has one."""
    rules: dict[str, str] = {}
    rests = []
    for i, trigger in enumerate(triggers):
        alts = []
        for j, (begin, schema, end) in enumerate(structures):
            if begin.startswith(trigger):
                rules[f"value{j}"] = _json(schema)
                parts = [json.dumps(begin[len(trigger):]), f"value{j}", json.dumps(end)]
                alts.append(" ".join(p for p in parts if p != '""'))
        rules[f"rest{i}"] = " | ".join(alts)
        rests.append(f"rest{i}")
    return _lark(triggered(rules, triggers, rests, "*"))


def triggered(rules: dict[str, str], triggers: list[str], rests: list[str],
              repeat: str) -> dict[str, str]:
    """`rules` with a `start` of text in which the first trigger found must be followed
    by its rest (the rule named alike), then text again ("*": any number of times, "?":
    once at most). Text is a lexeme that ends at the first trigger: a rest begins where
    the model wrote a trigger, never elsewhere."""
    leads = []
    for i, trigger in enumerate(triggers):
        rules[f"LEAD{i}"] = rf"/(?s:.*{_re(trigger)})/ & ~/(?s:.*({_any(triggers)}).+)/"
        leads.append(f"LEAD{i} {rests[i]}")
    rules["TAIL"] = _text_without(triggers)
    rules["start"] = f"({' | '.join(leads)}){repeat} TAIL"
    return rules


def _text_without(literals: list[str]) -> str:
    return rf"/(?s:.*)/ & ~/(?s:.*({_any(literals)}).*)/"


def _any(literals: list[str]) -> str:
    return "|".join(_re(t) for t in literals)


def _one_call(calls, key: str) -> dict:
    """One {"name": <a tool>, key: <its arguments>} object; every tool's `$defs` move up
    to the root, where the `#/$defs/...` references inside them point."""
    defs: dict = {}
    items = []
    for i, (name, params) in enumerate(calls):
        params = dict(params)
        for def_name, schema in (params.pop("$defs", None) or {}).items():
            if defs.get(def_name, schema) != schema:
                raise BadParam(f"tools[{i}].function.parameters.$defs.{def_name}",
                               f"tools: two tools define $defs.{def_name} differently")
            defs[def_name] = schema
        items.append({"type": "object", "properties": {
            "name": {"type": "string", "enum": [name]}, key: params},
            # nothing else: a key the call cannot carry is text the model must not write
            "required": ["name", key], "additionalProperties": False})
    return {"anyOf": items, **({"$defs": defs} if defs else {})}


def call_list(calls, key: str, parallel: bool) -> dict:
    """A list of at least one call (at most one unless `parallel`)."""
    one = _one_call(calls, key)
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": one["anyOf"]}}
    if not parallel:
        schema["maxItems"] = 1
    if "$defs" in one:
        schema["$defs"] = one["$defs"]
    return schema


def _json(schema: dict) -> str:
    return "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)


def _special_id(text: str, vocab) -> int | None:
    tid = vocab.token_to_id(text)
    return tid if tid is not None and vocab.is_special(tid) else None


def _mark(text: str, vocab) -> str:
    """A marker: its special token, or its text."""
    tid = _special_id(text, vocab)
    return json.dumps(text) if tid is None else f"<[{tid}]>"


def _re(text: str) -> str:
    """`text` literally, inside a /.../ regex on one line: every character that is not a
    letter or a digit by its code point (\\x{...}), which no regex or Lark reads as syntax."""
    return "".join(c if c.isalnum() else f"\\x{{{ord(c):x}}}" for c in text)


def _lark(rules: dict[str, str]) -> str:
    return "\n".join(f"{name}: {rule}" for name, rule in rules.items()) + "\n"
