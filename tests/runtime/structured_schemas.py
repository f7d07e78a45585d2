"""A suite of JSON schemas for structured output: nested objects, arrays with min/max items, enums, anyOf,
string patterns and formats, numbers with bounds, required and optional fields, $defs and $ref. Each test that
uses it checks the outputs with `jsonschema`, a validator that is not the grammar engine."""

from __future__ import annotations


def _obj(properties: dict, required=None, **kw) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        **kw,
    }


NAME = {"type": "string", "maxLength": 16}
WORD = {"type": "string", "pattern": "^[a-z]{1,8}$"}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    # scalars and enums
    {"type": "integer"},
    {"type": "number", "minimum": -5, "maximum": 5},
    {"type": "boolean"},
    {"type": "null"},
    {"type": "string", "maxLength": 20},
    {"enum": ["red", "green", "blue"]},
    {"enum": [1, "two", None, True]},
    {"const": "fixed"},
    {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20},
    {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
    {"type": "string", "format": "date"},
    {"type": "string", "minLength": 3, "maxLength": 5},
    # flat objects
    _obj({"name": NAME, "age": SMALL_INT}),
    _obj({"name": NAME, "age": SMALL_INT, "email": WORD}, required=["name"]),
    _obj({"ok": {"type": "boolean"}, "count": {"type": "integer", "minimum": 1}}),
    _obj({"level": {"enum": ["debug", "info", "warning", "error"]}, "message": NAME}),
    _obj({"x": {"type": "number"}, "y": {"type": "number"}, "z": {"type": "number"}}, required=["x", "y"]),
    _obj({"id": {"type": "string", "pattern": "^[0-9a-f]{4}$"}, "active": {"type": "boolean"}}),
    _obj({"price": {"type": "number", "minimum": 0, "maximum": 1000}, "currency": {"enum": ["EUR", "USD"]}}),
    _obj({}, required=[]),
    _obj({"a": {"type": "null"}, "b": {"const": 3}}),
    _obj({"when": {"type": "string", "format": "date-time"}, "where": NAME}, required=["when"]),
    # arrays
    {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": WORD, "minItems": 2, "maxItems": 3},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5},
    {"type": "array", "items": _obj({"k": WORD, "v": SMALL_INT}), "minItems": 1, "maxItems": 3},
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string", "maxLength": 6}], "items": False},
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}, "maxItems": 2},
    _obj({"tags": {"type": "array", "items": WORD, "maxItems": 4}, "title": NAME}),
    _obj(
        {
            "matrix": {
                "type": "array",
                "items": {"type": "array", "items": SMALL_INT, "minItems": 2, "maxItems": 2},
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),  # fmt: skip
    # nesting
    _obj(
        {
            "user": _obj(
                {"name": NAME, "address": _obj({"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})}
            )
        }
    ),
    _obj({"a": _obj({"b": _obj({"c": _obj({"d": {"type": "integer"}})})})}),
    _obj({"meta": _obj({"version": SMALL_INT, "draft": {"type": "boolean"}}, required=["version"]), "body": NAME}),
    _obj(
        {"items": {"type": "array", "items": _obj({"sku": WORD, "qty": SMALL_INT}), "maxItems": 3}, "total": SMALL_INT}
    ),
    _obj(
        {
            "point": _obj(
                {
                    "lat": {"type": "number", "minimum": -90, "maximum": 90},
                    "lon": {"type": "number", "minimum": -180, "maximum": 180},
                }
            )
        }
    ),  # fmt: skip
    # anyOf / oneOf / nullable
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
    {
        "anyOf": [
            _obj({"kind": {"const": "circle"}, "r": SMALL_INT}),
            _obj({"kind": {"const": "square"}, "side": SMALL_INT}),
        ]
    },
    _obj({"value": {"anyOf": [{"type": "null"}, SMALL_INT]}}),
    _obj({"result": {"oneOf": [_obj({"ok": {"const": True}}), _obj({"error": NAME})]}}),
    {"type": ["string", "null"], "maxLength": 10},
    _obj({"shape": {"anyOf": [{"enum": ["dot"]}, _obj({"w": SMALL_INT, "h": SMALL_INT})]}}),
    # $defs and $ref
    {
        "$defs": {"person": _obj({"name": NAME, "age": SMALL_INT})},
        **_obj({"a": {"$ref": "#/$defs/person"}, "b": {"$ref": "#/$defs/person"}}),
    },  # fmt: skip
    {"$defs": {"leaf": {"type": "integer"}}, "type": "array", "items": {"$ref": "#/$defs/leaf"}, "maxItems": 3},
    # optional fields and closed or open objects
    _obj({"a": SMALL_INT, "b": SMALL_INT, "c": SMALL_INT}, required=[]),
    _obj({"a": SMALL_INT}, additionalProperties={"type": "boolean"}, maxProperties=3),
    _obj({"first": NAME, "last": NAME, "middle": NAME}, required=["first", "last"]),
    # mixed
    _obj(
        {
            "title": NAME,
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "horror"]}, "minItems": 1, "maxItems": 2},
            "rating": {"type": "number", "minimum": 0, "maximum": 10},
        }
    ),  # fmt: skip
    _obj(
        {
            "status": {"enum": ["open", "closed"]},
            "assignee": {"anyOf": [{"type": "null"}, NAME]},
            "labels": {"type": "array", "items": WORD, "maxItems": 2},
        }
    ),  # fmt: skip
    _obj({"function": {"const": "get_weather"}, "arguments": _obj({"city": NAME, "unit": {"enum": ["c", "f"]}})}),
    _obj(
        {
            "ok": {"type": "boolean"},
            "data": {"type": "array", "items": {"type": "number"}, "maxItems": 3},
            "error": {"type": ["string", "null"], "maxLength": 12},
        },
        required=["ok"],
    ),  # fmt: skip
    _obj(
        {"q": {"type": "string", "enum": ["yes", "no"]}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}
    ),
]
