"""The client's JSON body in and the legs' body out: parsed once, never re-shaped.

orjson does the work. It keeps integers exactly only within 64 bits and turns larger ones into
floats, which would silently change a client's value on its way to the workers
(``18446744073709551616`` -> ``1.8446744073709552e+19``). So a body whose text holds a run of 19
or more digits (the only way to spell such an integer) is parsed a second time with the
standard library, which keeps every integer exact, and dumped with it too. Both parsers agree on
everything else (orjson, being stricter, validates first), so the legs get the client's values
one for one. The slow path costs nothing on ordinary bodies: one C regex scan.
"""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from trio_pd.errors import bad_request

# A digit run long enough to overflow 64 bits (or to sit inside a string: the slow path is then
# merely unnecessary, never wrong).
_LONG_DIGITS = re.compile(rb"\d{19}")


def parse_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, integers exact, or a 400 saying what is wrong with it."""
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise bad_request("request body must be a JSON object")
    if _LONG_DIGITS.search(body) is not None:
        payload = _parse_exact(body)
    return payload


def _parse_exact(body: bytes) -> dict[str, Any]:
    try:
        return json.loads(body, parse_constant=_no_constants)
    except ValueError as exc:  # e.g. an integer beyond Python's 4300-digit conversion limit
        raise bad_request(f"request body holds a number the router cannot carry: {exc}") from None
    except RecursionError:
        raise too_deep() from None


def too_deep() -> Exception:
    return bad_request(
        "request body nests too deeply for the router to carry its integers exactly "
        "(keep it under ~900 levels, or its integers within 64 bits)"
    )


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def dump(payload: Any) -> bytes:
    """Serialize what `parse_object` gave (plus the router's own fields) for the legs."""
    try:
        return orjson.dumps(payload)
    except orjson.JSONEncodeError:  # an integer beyond 64 bits, or past orjson's depth limit
        try:
            return json.dumps(
                payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False
            ).encode()
        except RecursionError:
            raise too_deep() from None
