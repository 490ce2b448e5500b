"""The request fields that constrain an HTTP request's output, mapped onto
SamplingParams.structured (docs/SERVING.md, Structured outputs and tool calls):

  response_format     OpenAI's {"type": "text" | "json_object" | "json_schema", ...}, and
                      vLLM's {"type": "structural_tag", "structures", "triggers"}
  structured_outputs  vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object" |
                      "structural_tag": ...}
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older fields

Each constraint keeps the field it came from: whoever refuses it later (the gateway's check
of its form, the engine's grammar compiler) names a `sampling.structured.<kind>` field,
which the HTTP API reports as the field the user sent."""
from __future__ import annotations

import json
from dataclasses import dataclass

from loramux.v1 import generate_pb2

from loramux_services.gateway.call_grammar import tag_grammar
from loramux_services.gateway.errors import BadParam

_RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
_TAG_KEYS = {"type", "structures", "triggers"}
# vLLM's structured_outputs keys, each to the StructuredOutput field it sets
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object", "structural_tag": "grammar"}
# accepted and ignored: it picks among vLLM's backends, and loramux has one
_IGNORED = {"disable_fallback"}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


@dataclass(frozen=True)
class Constraint:
    """A constraint on the output and the request field it came from."""
    structured: generate_pb2.StructuredOutput
    param: str


def constraint_of(response_format: dict | None, structured_outputs: dict | None,
                  guided: dict) -> Constraint | None:
    """The one constraint the fields give (None: free text); 400 when more than one
    field constrains the output, or one is malformed. `guided`: the guided_* fields."""
    found = [c for c in (_response_format(response_format),
                         _structured_outputs(structured_outputs),
                         *(_value(GUIDED[k], v, k) for k, v in guided.items() if v is not None))
             if c is not None]
    if len(found) > 1:
        raise BadParam(found[1].param, f"{found[0].param} and {found[1].param} both "
                       "constrain the output; give one")
    return found[0] if found else None


def _response_format(rf: dict | None) -> Constraint | None:
    if rf is None:
        return None
    kind = rf.get("type")
    if kind not in _RESPONSE_FORMATS:
        raise BadParam("response_format.type", f"response_format.type: {kind!r} is not one of "
                       f"{', '.join(map(repr, _RESPONSE_FORMATS))}")
    if kind == "structural_tag":
        return structural_tag(rf, "response_format")
    allowed = {"type", "json_schema"} if kind == "json_schema" else {"type"}
    _no_unknown(rf, allowed, "response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(generate_pb2.StructuredOutput(json_object=True), "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise BadParam("response_format.json_schema", "response_format.json_schema: an object "
                       "with the JSON schema in `schema` is required")
    _no_unknown(spec, _SCHEMA_KEYS, "response_format.json_schema")
    return schema_constraint(spec.get("schema"), "response_format.json_schema.schema")


def _no_unknown(obj: dict, allowed: set[str], where: str) -> None:
    for key in obj:
        if key not in allowed:
            raise BadParam(f"{where}.{key}", f"{where}.{key} is not supported")


def _structured_outputs(so: dict | None) -> Constraint | None:
    if so is None:
        return None
    _no_unknown(so, set(_KINDS) | _IGNORED, "structured_outputs")
    given = [k for k in _KINDS if so.get(k) not in (None, False)]
    if len(given) != 1:
        raise BadParam("structured_outputs", "structured_outputs: give exactly one of "
                       f"{', '.join(_KINDS)} (got {', '.join(given) or 'none'})")
    key = given[0]
    return _value(key, so[key], f"structured_outputs.{key}")


def _value(key: str, value, param: str) -> Constraint:
    """structured_outputs' `key` (json, regex, choice, grammar, json_object) as given."""
    if key == "json":
        return schema_constraint(value, param)
    if key == "structural_tag":
        return structural_tag(value, param)
    if key == "json_object":
        if value is not True:
            raise BadParam(param, f"{param}: must be true")
        return Constraint(generate_pb2.StructuredOutput(json_object=True), param)
    if key == "choice":
        if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
            raise BadParam(param, f"{param}: a list of strings is required")
        return Constraint(generate_pb2.StructuredOutput(
            choice=generate_pb2.Choices(choices=value)), param)
    if not isinstance(value, str):
        raise BadParam(param, f"{param}: a string is required")
    return Constraint(generate_pb2.StructuredOutput(**{_KINDS[key]: value}), param)


def schema_constraint(schema, param: str) -> Constraint:
    """A JSON schema given as an object or as its JSON text."""
    schema = _object(schema, param, "a JSON schema (an object)")
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise BadParam(param, f"{param}: nested too deeply") from None
    return Constraint(generate_pb2.StructuredOutput(json_schema=text), param)


def structural_tag(spec, param: str) -> Constraint:
    """vLLM's structural tag, {"structures": [{"begin", "schema", "end"}, ...], "triggers":
    [...]} (as an object or its JSON text), as the grammar that holds it (tag_grammar)."""
    spec = _object(spec, param, "an object with structures and triggers")
    _no_unknown(spec, _TAG_KEYS, param)
    triggers, structures = spec.get("triggers"), spec.get("structures")
    if not isinstance(triggers, list) or not triggers or \
            not all(isinstance(t, str) and t for t in triggers):
        raise BadParam(f"{param}.triggers", f"{param}.triggers: a list of non-empty strings "
                       "is required")
    if not isinstance(structures, list) or not structures:
        raise BadParam(f"{param}.structures", f"{param}.structures: a list of "
                       "{begin, schema, end} objects is required")
    parts = []
    for i, item in enumerate(structures):
        where = f"{param}.structures[{i}]"
        item = _object(item, where, "an object with begin, schema and end")
        _no_unknown(item, {"begin", "schema", "end"}, where)
        begin, schema, end = item.get("begin"), item.get("schema", True), item.get("end")
        if not isinstance(begin, str) or not isinstance(end, str):
            raise BadParam(where, f"{where}: begin and end are strings")
        if not any(begin.startswith(t) for t in triggers):
            raise BadParam(f"{where}.begin", f"{where}.begin: {begin[:80]!r} starts with "
                           "none of the triggers")
        schema = _object(schema, f"{where}.schema", "a JSON schema (an object)")
        parts.append((begin, schema, end))
    for i, trigger in enumerate(triggers):
        if not any(begin.startswith(trigger) for begin, _, _ in parts):
            raise BadParam(f"{param}.triggers[{i}]", f"{param}.triggers[{i}]: no structure's "
                           f"begin starts with {trigger[:80]!r}")
    return Constraint(generate_pb2.StructuredOutput(grammar=tag_grammar(parts, triggers)), param)


def _object(value, param: str, what: str) -> dict:
    """`value`, or the object its JSON text holds (True: {}, any value); 400 naming
    `param` otherwise."""
    value = _parsed(value, param)
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise BadParam(param, f"{param}: {what} is required")
    return value


def _parsed(value, param: str):
    """`value`, or what its JSON text holds."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as err:
        raise BadParam(param, f"{param}: not JSON: {str(err)[:200]}") from None


def renamed(message: str, field: str | None, param: str) -> str:
    """`message` about `field` (sampling.structured.<kind>) told about `param` instead."""
    if field and message.startswith(field):
        return param + message[len(field):]
    return f"{param}: {message}"
