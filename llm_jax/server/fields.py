"""Request bodies read strictly: JSON in, checked values out, or an :class:`ApiError` naming the field.

Types are JSON's and strict: ``true`` is not a number, ``1.5`` is not an integer, ``NaN`` is not JSON. A
null field takes its default. :class:`Fields` hands out a body's fields one by one and refuses, at the
end, any that no one took (as OpenAI does) — but for the few OpenAI accepts without effect on generation.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

IGNORED = frozenset({"user", "metadata", "store", "service_tier"})  # accepted, no effect on generation


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with ``status``."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def parse_json(raw: bytes) -> Any:
    """The body as JSON, refusing what ``json`` accepts but JSON does not (NaN, Infinity, numbers that
    overflow a float) and text that cannot travel back as UTF-8 (lone surrogates)."""

    def refuse(constant: str):
        raise ValueError(f"{constant} is not valid JSON")

    try:
        value = json.loads(raw, parse_constant=refuse)
        # Numbers beyond float's range (1e400 reads as inf) and lone surrogates ("\ud800") fail here.
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except (ValueError, RecursionError) as error:
        raise ApiError(f"the request body is not valid JSON: {short(str(error), 200)}", code="invalid_json") from None
    return value


def short(text: str, limit: int = 80) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


def show(value: Any) -> str:
    return short(json.dumps(value, ensure_ascii=False))


_KINDS = {"string": "a string", "integer": "an integer", "number": "a number", "boolean": "a boolean",
          "array": "an array", "object": "an object"}


def kind_of(value: Any) -> str:
    match value:
        case bool():
            return "boolean"
        case int():
            return "integer"
        case float():
            return "number"
        case str():
            return "string"
        case list():
            return "array"
        case dict():
            return "object"
    return "null"


def check_kind(value: Any, param: str, *kinds: str) -> Any:
    """``value`` if its JSON type is one of ``kinds`` (an integer is also a number), else an error."""
    kind = kind_of(value)
    if kind in kinds or (kind == "integer" and "number" in kinds):
        return value
    expected = " or ".join(_KINDS[k] for k in kinds)
    raise ApiError(f"{param} must be {expected}, got {show(value)}", param=param, code="invalid_type")


def check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ApiError(f"{param} {message}", param=param, code="invalid_value")


class Fields:
    """A body's fields, taken one by one; :meth:`finish` refuses whatever no one took."""

    def __init__(self, body: Any):
        if not isinstance(body, dict):
            raise ApiError(f"the request body must be a JSON object, got {show(body)}", code="invalid_type")
        self._left = dict(body)

    def take(self, name: str, *kinds: str, default: Any = None) -> Any:
        value = self._left.pop(name, None)
        return default if value is None else check_kind(value, name, *kinds)

    def peek(self, name: str) -> Any:
        """A field's value as sent, left to be taken."""
        return self._left.get(name)

    def required(self, name: str, *kinds: str) -> Any:
        if self._left.get(name) is None:
            raise ApiError(f"{name} is required", param=name, code="missing_field")
        return self.take(name, *kinds)

    def unsupported(self, name: str, accepted: Any = None, why: str = "is not supported by this server") -> None:
        """Refuse ``name`` unless it is absent, null or ``accepted``."""
        value = self._left.pop(name, None)
        if value is not None and value != accepted:
            raise ApiError(f"{name}={show(value)} {why}", param=name, code="unsupported")

    def finish(self) -> None:
        for name in IGNORED:
            self._left.pop(name, None)
        if self._left:
            name = next(iter(self._left))
            raise ApiError(f"Unrecognized request argument supplied: {name}", param=name, code="unknown_field")


def integer(fields: Fields, name: str, low: int, high: int, default: int | None = None) -> int | None:
    value = fields.take(name, "integer", default=default)
    if value is not None:
        check(low <= value <= high, name, f"must be in [{low}, {high}], got {value}")
    return value


def number(fields: Fields, name: str, default: float, accept, expected: str) -> float:
    value = fields.take(name, "number", default=default)
    try:
        value = float(value)
    except OverflowError:  # an integer beyond float's range
        value = math.inf
    check(accept(value), name, f"must be {expected}, got {show(value) if math.isfinite(value) else 'a huge number'}")
    return value


def token_ids(value: Any, param: str, vocab_size: int) -> tuple[int, ...]:
    """A non-empty list of token ids in the vocabulary."""
    check_kind(value, param, "array")
    check(len(value) > 0, param, "must not be empty")
    for i, token in enumerate(value):
        check_kind(token, f"{param}[{i}]", "integer")
        check(0 <= token < vocab_size, param, f"holds token id {token}, outside the vocabulary [0, {vocab_size})")
    return tuple(value)
