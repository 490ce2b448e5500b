"""JSON schemas of real size for the constrained-decoding benchmark (bench_structured.py):
function-calling parameters, nested objects with arrays and enums, a 30-property
extraction, $defs/$ref, anyOf, and the long document the decode rows write."""
from __future__ import annotations

_STR, _INT, _NUM, _BOOL = ({"type": t} for t in ("string", "integer", "number", "boolean"))


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "additionalProperties": False,
            "required": list(props) if required is None else required}


_ADDRESS = _obj({"street": _STR, "city": _STR, "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                 "country": {"enum": ["US", "CA", "GB", "FR", "DE", "JP", "IN", "BR"]}})
_KINDS = [_STR, _INT, _NUM, _BOOL, {"enum": ["low", "medium", "high"]},
          {"type": ["string", "null"]}]

SCHEMAS = {
    "weather_call": _obj({"location": _STR, "unit": {"enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 14},
                          "hourly": _BOOL}),
    "search_call": _obj({"query": {"type": "string", "minLength": 1, "maxLength": 200},
                         "filters": {"type": "array", "items": _obj(
                             {"field": _STR, "op": {"enum": ["eq", "lt", "gt", "in"]},
                              "value": {"anyOf": [_STR, _NUM, {"type": "array", "items": _STR}]}})},
                         "limit": {"type": "integer", "minimum": 1, "maximum": 100}},
                        ["query"]),
    "order": _obj({"id": _STR, "customer": _obj({"name": _STR, "email": {"type": "string",
                                                                         "format": "email"},
                                                 "address": _ADDRESS}),
                   "items": {"type": "array", "minItems": 1, "items": _obj(
                       {"sku": _STR, "qty": {"type": "integer", "minimum": 1}, "price": _NUM,
                        "tags": {"type": "array", "items": _STR}})},
                   "status": {"enum": ["pending", "paid", "shipped", "delivered"]},
                   "notes": {"type": ["string", "null"]}}),
    "extract_30": _obj({f"field_{i:02d}": _KINDS[i % len(_KINDS)] for i in range(30)}),
    "defs_ref": {"$defs": {"person": _obj({"name": _STR, "born": {"type": "string",
                                                                  "format": "date"},
                                           "parents": {"type": "array", "maxItems": 2,
                                                       "items": {"$ref": "#/$defs/stub"}}}),
                           "stub": _obj({"name": _STR})},
                 **_obj({"subject": {"$ref": "#/$defs/person"},
                         "relatives": {"type": "array", "items": {"$ref": "#/$defs/person"}}})},
    "events_anyof": _obj({"events": {"type": "array", "items": {"anyOf": [
        _obj({"type": {"const": "click"}, "x": _INT, "y": _INT}),
        _obj({"type": {"const": "key"}, "key": _STR, "mods": {"type": "array", "items": {
            "enum": ["ctrl", "alt", "shift", "meta"]}}}),
        _obj({"type": {"const": "scroll"}, "dy": _NUM})]}}}),
    "profile_patterns": _obj({
        "username": {"type": "string", "pattern": "^[a-z][a-z0-9_]{2,15}$"},
        "phone": {"type": "string", "pattern": "^\\+?[0-9]{1,3}-[0-9]{3}-[0-9]{4}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "bio": {"type": "string", "maxLength": 200}, "id": {"type": "string", "format": "uuid"}}),
    "tool_calls": _obj({"calls": {"type": "array", "minItems": 1, "items": _obj(
        {"name": {"enum": ["get_weather", "search", "send_email", "create_event"]},
         "arguments": {"type": "object"}})}}),
    "table": _obj({"columns": {"type": "array", "items": _STR},
                   "rows": {"type": "array", "items": {"type": "array",
                                                       "items": {"type": ["number", "null"]}}}}),
    "nullable_oneof": _obj({"result": {"oneOf": [_obj({"ok": {"const": True}, "value": _NUM}),
                                                 _obj({"ok": {"const": False}, "error": _STR})]},
                            "meta": {"type": ["object", "null"]}}),
}

# what every constrained decode row writes: long enough (at least 40 records) that no row
# finishes inside the timed steps
LONG = _obj({"rows": {"type": "array", "minItems": 40, "items": _obj(
    {"id": _INT, "name": {"type": "string", "minLength": 4}, "kind": {"enum": ["a", "b", "c"]},
     "score": _NUM})}})
