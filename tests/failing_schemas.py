"""JSON schemas whose grammars llguidance cannot follow (engine/sampling/grammar.py): those its compile's
probe finds, and ones that fail only off the probe's path, where a model goes."""

from __future__ import annotations

from typing import Any

RECURSES = {"$ref": "#/$defs/a"}  # a $ref that only recurses: nothing can be its value
DEFS = {"a": RECURSES}


def properties(count: int, required: list[str] | None = None) -> dict[str, Any]:
    """An object of `count` integer properties p0, p1, ...; optional but those required."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {f"p{i}": {"type": "integer"} for i in range(count)},
    }
    return schema if required is None else {**schema, "required": required}


# schemas that once ended "stop" with output that does not parse, and what the 400 that refuses each names
PROBED_SCHEMAS = {
    "500 optional properties": properties(500),
    "1,000 properties, p0 required": properties(1000, required=["p0"]),
    "a recursive $ref": {"$defs": DEFS, "type": "object", "properties": {"x": RECURSES}, "required": ["x"]},
}
NAMED = {
    "500 optional properties": "too many alternatives",
    "1,000 properties, p0 required": "too many alternatives",
    "a recursive $ref": "no base case",
}


def past_the_probe(member: dict[str, Any]) -> dict[str, Any]:
    """null, or an object whose one property is `member`: the probe takes null (its bytes are the lowest,
    and it tries the brace only one token deep), a model asked for an object as JSON the object."""
    river = {
        "type": "object",
        "properties": {"river": member},
        "required": ["river"],
        "additionalProperties": False,
    }
    return {"$defs": DEFS, "anyOf": [{"type": "null"}, river]}
