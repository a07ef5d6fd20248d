"""A table of JSON schemas with an instance of each: what constrained decoding is measured and tested on.

Each :class:`SchemaCase` holds a schema applications send (nested objects, arrays, enums, ``anyOf``,
string formats, ``$ref`` recursion, ...) and one instance that validates against it. The benchmark
(``plinth bench structured``) walks each instance token by token through the grammar library and
times the masks; the tests decode with each schema and validate what comes out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SchemaCase:
    """A named schema and an instance that validates against it."""

    name: str
    schema: dict[str, Any]
    instance: Any


_PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150}},
    "required": ["name", "age"],
    "additionalProperties": False,
}

SCHEMAS: list[SchemaCase] = [
    SchemaCase("flat-object", _PERSON, {"name": "Ada", "age": 36}),
    SchemaCase(
        "optional-properties",
        {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "nickname": {"type": "string"}, "active": {"type": "boolean"}},
            "required": ["id"],
            "additionalProperties": False,
        },
        {"id": 7, "active": True},
    ),
    SchemaCase(
        "nested-object",
        {
            "type": "object",
            "properties": {
                "user": _PERSON,
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["user", "address"],
            "additionalProperties": False,
        },
        {"user": {"name": "Lin", "age": 29}, "address": {"city": "Oslo", "zip": "01234"}},
    ),
    SchemaCase(
        "array-of-strings",
        {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        ["red", "green"],
    ),
    SchemaCase("array-of-objects", {"type": "array", "items": _PERSON, "maxItems": 3}, [{"name": "Bo", "age": 3}]),
    SchemaCase(
        "string-enum",
        {
            "type": "object",
            "properties": {"colour": {"enum": ["red", "green", "blue"]}},
            "required": ["colour"],
            "additionalProperties": False,
        },
        {"colour": "green"},
    ),
    SchemaCase("mixed-enum", {"enum": ["auto", 1, 2.5, None, True]}, 2.5),
    SchemaCase("const", {"type": "object", "properties": {"v": {"const": "1.0"}}, "required": ["v"]}, {"v": "1.0"}),
    SchemaCase(
        "anyOf",
        {
            "anyOf": [
                {"type": "integer"},
                {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]},
            ]
        },
        {"x": -1.5},
    ),
    SchemaCase(
        "oneOf-tagged",
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "circle"}, "r": {"type": "number"}},
                    "required": ["kind", "r"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "square"}, "side": {"type": "number"}},
                    "required": ["kind", "side"],
                    "additionalProperties": False,
                },
            ]
        },
        {"kind": "square", "side": 2},
    ),
    SchemaCase("nullable", {"type": ["string", "null"]}, None),
    SchemaCase(
        "number-bounds",
        {
            "type": "object",
            "properties": {
                "p": {"type": "number", "minimum": 0, "maximum": 1},
                "n": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            },
            "required": ["p", "n"],
            "additionalProperties": False,
        },
        {"p": 0.25, "n": 9},
    ),
    SchemaCase(
        "string-length",
        {"type": "string", "minLength": 3, "maxLength": 8},
        "plinth",
    ),
    SchemaCase("pattern", {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "ABC-123"),
    SchemaCase("format-date", {"type": "string", "format": "date"}, "2026-12-02"),
    SchemaCase("format-date-time", {"type": "string", "format": "date-time"}, "2026-12-02T04:05:06Z"),
    SchemaCase("format-email", {"type": "string", "format": "email"}, "ada@example.org"),
    SchemaCase("format-uuid", {"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000"),
    SchemaCase("format-ipv4", {"type": "string", "format": "ipv4"}, "192.168.0.1"),
    SchemaCase(
        "tuple-prefixItems",
        {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}], "items": False},
        ["x", 3],
    ),
    SchemaCase(
        "defs-ref",
        {
            "$defs": {
                "point": {
                    "type": "object",
                    "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                    "required": ["x", "y"],
                    "additionalProperties": False,
                }
            },
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
        {"a": {"x": 1, "y": 2}, "b": {"x": 3, "y": 4}},
    ),
    SchemaCase(
        "recursive-tree",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": {"type": "integer"},
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        {"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": []}]},
    ),
    SchemaCase(
        "allOf",
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        {"a": 1, "b": "two"},
    ),
    SchemaCase(
        "additional-properties-typed",
        {"type": "object", "additionalProperties": {"type": "integer"}},
        {"apples": 3, "pears": 5},
    ),
    SchemaCase(
        "tool-call-arguments",
        {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "a city"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["location", "unit"],
            "additionalProperties": False,
        },
        {"location": "Paris", "unit": "celsius", "days": 3},
    ),
    SchemaCase("any-json", {}, {"anything": [1, "two", {"three": None}]}),
]

#: Schemas with a keyword a grammar cannot enforce token by token: a request carrying one is refused
#: (a 400 naming the keyword), never answered unconstrained. Keyed by the keyword expected in the error.
UNENFORCEABLE: dict[str, dict[str, Any]] = {
    "uniqueItems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    "not": {"not": {"type": "string"}},
    "if": {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
}
