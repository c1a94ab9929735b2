"""A brute-force judge of grammar masks: is a byte string still a prefix of valid output?

For the JSON Schema subset the library benchmark uses (objects with every property listed and
`additionalProperties: false`, strings with length bounds, integers with small ranges, numbers,
booleans, null, enum/const, arrays with item bounds, anyOf, `type` lists, local `$ref`), a schema
becomes one regular expression over UTF-8 bytes of the fixed JSON form the server enforces
(`", "` and `": "`, no other whitespace, properties in schema order). The `regex` package's
partial matching then answers "can this prefix still be completed?" without either grammar
library, so the two can be judged against it token by token.

Independent of llguidance and xgrammar on purpose: it is the slow reference for their fast masks.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import regex

# One character of a JSON string, as UTF-8 bytes: a well-formed non-control character other than
# `"` and `\`, or an escape (an escape counts as one character for the length bounds).
_UTF8_CHAR = (
    rb"[\x20\x21\x23-\x5b\x5d-\x7f]"
    rb"|[\xc2-\xdf][\x80-\xbf]"
    rb"|\xe0[\xa0-\xbf][\x80-\xbf]|[\xe1-\xec\xee\xef][\x80-\xbf]{2}|\xed[\x80-\x9f][\x80-\xbf]"
    rb"|\xf0[\x90-\xbf][\x80-\xbf]{2}|[\xf1-\xf3][\x80-\xbf]{3}|\xf4[\x80-\x8f][\x80-\xbf]{2}"
    rb'|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4}'
)
_NUMBER = rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_INTEGER = rb"-?(?:0|[1-9][0-9]*)"
_LARGEST_ENUMERATED_RANGE = 5000


def _literal(value: Any) -> bytes:
    return regex.escape(json.dumps(value, ensure_ascii=False, separators=(", ", ": ")).encode())


def _alternatives(parts: list[bytes]) -> bytes:
    return b"(?:" + b"|".join(parts) + b")"


class SchemaRegex:
    """`schema` -> a compiled bytes regex of its values in the fixed JSON form."""

    def __init__(self, schema: Mapping[str, Any]) -> None:
        self.defs: Mapping[str, Any] = schema.get("$defs", {})
        self.pattern = regex.compile(self._value(schema))

    def is_prefix(self, data: bytes) -> bool:
        """Some continuation of `data` (possibly none) is a complete value."""
        return self.pattern.fullmatch(data, partial=True) is not None

    def is_complete(self, data: bytes) -> bool:
        return self.pattern.fullmatch(data) is not None

    def _value(self, schema: Mapping[str, Any]) -> bytes:
        if "$ref" in schema:
            prefix = "#/$defs/"
            reference = schema["$ref"]
            if not reference.startswith(prefix):
                raise ValueError(f"only local $defs references are supported, not {reference}")
            return self._value(self.defs[reference[len(prefix) :]])
        if "const" in schema:
            return _literal(schema["const"])
        if "enum" in schema:
            return _alternatives([_literal(value) for value in schema["enum"]])
        if "anyOf" in schema:
            return _alternatives([self._value(option) for option in schema["anyOf"]])
        kind = schema.get("type")
        if isinstance(kind, list):
            return _alternatives([self._value({**schema, "type": one}) for one in kind])
        if kind == "string":
            low, high = schema.get("minLength", 0), schema.get("maxLength")
            repeat = b"{%d,%s}" % (low, b"" if high is None else str(high).encode())
            return b'"(?:' + _UTF8_CHAR + b")" + repeat + b'"'
        if kind == "integer":
            return self._integer(schema)
        if kind == "number":
            return _NUMBER
        if kind == "boolean":
            return b"(?:true|false)"
        if kind == "null":
            return b"null"
        if kind == "array":
            return self._array(schema)
        if kind == "object":
            return self._object(schema)
        raise ValueError(f"the oracle does not cover {json.dumps(schema)[:80]}")

    def _integer(self, schema: Mapping[str, Any]) -> bytes:
        low, high = schema.get("minimum"), schema.get("maximum")
        if low is None or high is None:
            return _INTEGER
        if high - low > _LARGEST_ENUMERATED_RANGE:
            raise ValueError(f"integer range [{low}, {high}] is too wide for the oracle")
        return _alternatives([str(value).encode() for value in range(int(low), int(high) + 1)])

    def _array(self, schema: Mapping[str, Any]) -> bytes:
        item = self._value(schema.get("items", {"type": "null"}))
        low, high = schema.get("minItems", 0), schema.get("maxItems")
        rest = b"(?:, " + item + b"){%d,%s}" % (max(low - 1, 0), b"" if high is None else str(high - 1).encode())
        body = item + rest
        return rb"\[" + (body if low > 0 else b"(?:" + body + b")?") + rb"\]"

    def _object(self, schema: Mapping[str, Any]) -> bytes:
        if schema.get("additionalProperties", True) is not False:
            raise ValueError("the oracle needs additionalProperties: false")
        required = set(schema.get("required", ()))
        members = [(_literal(name) + b": " + self._value(sub), name in required) for name, sub in schema.get("properties", {}).items()]

        def sequence(start: int, first: bool) -> bytes:
            if start == len(members):
                return b""
            member, is_required = members[start]
            present = (b"" if first else b", ") + member + sequence(start + 1, False)
            if is_required:
                return present
            return b"(?:" + present + b"|" + sequence(start + 1, first) + b")"

        return rb"\{" + sequence(0, True) + rb"\}"
