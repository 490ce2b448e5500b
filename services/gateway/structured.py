"""The request fields that constrain an HTTP request's output, mapped onto
SamplingParams.structured (docs/SERVING.md, Structured outputs and tool calls):

  response_format     OpenAI's {"type": "text" | "json_object" | "json_schema", ...}
  structured_outputs  vLLM's {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
  guided_json, guided_regex, guided_choice, guided_grammar   vLLM's older fields

Each constraint keeps the field it came from: whoever refuses it later (the gateway's check
of its form, the engine's grammar compiler) names a `sampling.structured.<kind>` field,
which the HTTP API reports as the field the user sent."""
from __future__ import annotations

import json
from dataclasses import dataclass

from loramux.v1 import generate_pb2

from loramux_services.gateway.errors import BadParam

_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
# vLLM's structured_outputs keys, each to the StructuredOutput field it sets
_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
          "json_object": "json_object"}
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
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError) as err:
            raise BadParam(param, f"{param}: not JSON: {str(err)[:200]}") from None
    if not isinstance(schema, dict):
        raise BadParam(param, f"{param}: a JSON schema (an object) is required")
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise BadParam(param, f"{param}: nested too deeply") from None
    return Constraint(generate_pb2.StructuredOutput(json_schema=text), param)


def renamed(message: str, field: str | None, param: str) -> str:
    """`message` about `field` (sampling.structured.<kind>) told about `param` instead."""
    if field and message.startswith(field):
        return param + message[len(field):]
    return f"{param}: {message}"
