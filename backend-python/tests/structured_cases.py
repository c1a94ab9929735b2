"""Schemas, tools and sampling settings shared by the structured-output tests."""

from __future__ import annotations

from typing import Any

SAMPLED = {"temperature": 1.0, "top_p": 0.9, "max_tokens": 200}
GREEDY = {"temperature": 0, "presence_penalty": 0, "frequency_penalty": 0, "max_tokens": 60}

NAME = {"type": "string", "minLength": 1, "maxLength": 10}
SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {
        "type": "object",
        "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "member": {"type": "boolean"}},
        "required": ["name", "age", "member"],
        "additionalProperties": False,
    },
    "enum-and-array": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
            "note": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["color", "scores", "note"],
        "additionalProperties": False,
    },
    "nested-ref-anyof": {
        "type": "object",
        "properties": {
            "owner": {"$ref": "#/$defs/person"},
            "pets": {"type": "array", "items": {"$ref": "#/$defs/pet"}, "maxItems": 2},
            "where": {"anyOf": [{"const": "home"}, {"type": "integer", "minimum": 1, "maximum": 99}]},
        },
        "required": ["owner", "pets", "where"],
        "additionalProperties": False,
        "$defs": {
            "person": {"type": "object", "properties": {"name": NAME, "vip": {"type": "boolean"}}, "required": ["name", "vip"], "additionalProperties": False},
            "pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0, "maximum": 30}}, "required": ["kind"], "additionalProperties": False},
        },
    },
}
WEATHER_PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}}, "required": ["zone"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather.", "parameters": WEATHER_PARAMETERS}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMETERS}},
]
PARAMETERS = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
USER = [{"role": "user", "content": "Give me the data as JSON."}]
BACKENDS = {"classic": "cpu fp32", "albatross": "albatross workers=1 batch=4 device=cpu"}  # strategies on the CPU


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
