"""etcd v3's JSON gateway as values: base64 keys, key-values, watch events, txn parts.

The gateway speaks gRPC's messages as JSON, bytes in base64 and 64-bit integers as strings; the
builders here make those shapes and read them back, with no I/O (the client sends them).
"""

from __future__ import annotations

import base64
from collections.abc import Mapping
from typing import Any

import attrs


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def prefix_end(prefix: bytes) -> bytes:
    """The range end covering every key that starts with ``prefix`` (etcd's `WithPrefix`)."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\x00"  # every key


@attrs.frozen
class KeyValue:
    key: bytes
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int = 0

    @classmethod
    def from_json(cls, kv: Mapping[str, Any]) -> KeyValue:
        return cls(
            key=unb64(kv.get("key")),
            value=unb64(kv.get("value")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@attrs.frozen
class WatchEvent:
    type: str  # "PUT" or "DELETE"
    kv: KeyValue


def header_revision(body: Mapping[str, Any]) -> int:
    return int(body.get("header", {}).get("revision", 0))


def cmp_created(key: bytes, revision: int) -> dict[str, Any]:
    """Compare: the key's create revision is ``revision`` (0: the key does not exist)."""
    return {
        "key": b64(key),
        "target": "CREATE",
        "result": "EQUAL",
        "create_revision": str(revision),
    }


def cmp_modified(key: bytes, revision: int) -> dict[str, Any]:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def cmp_value(key: bytes, value: bytes) -> dict[str, Any]:
    return {"key": b64(key), "target": "VALUE", "result": "EQUAL", "value": b64(value)}


def op_put(key: bytes, value: bytes, lease: int = 0) -> dict[str, Any]:
    put: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease:
        put["lease"] = str(lease)
    return {"request_put": put}


def op_range(key: bytes) -> dict[str, Any]:
    return {"request_range": {"key": b64(key)}}


def op_delete(key: bytes) -> dict[str, Any]:
    return {"request_delete_range": {"key": b64(key)}}


def txn_kvs(answer: Mapping[str, Any], index: int) -> list[KeyValue]:
    """The keys a txn's ``index``-th operation (a range) found."""
    responses = answer.get("responses", [])
    found = responses[index].get("response_range", {}) if index < len(responses) else {}
    return [KeyValue.from_json(kv) for kv in found.get("kvs", ())]


def txn_deleted(answer: Mapping[str, Any], index: int) -> int:
    responses = answer.get("responses", [])
    found = responses[index].get("response_delete_range", {}) if index < len(responses) else {}
    return int(found.get("deleted", 0))
