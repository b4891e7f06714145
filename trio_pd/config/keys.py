"""Control-plane keys (`--control-plane-api-keys 'id:name:role:key'`) as configuration values."""

from __future__ import annotations

from collections.abc import Sequence

import attrs

ROLES = ("admin", "user")


@attrs.frozen
class ControlKey:
    """One `--control-plane-api-keys` entry: `id:name:role:key` (the key may hold colons)."""

    id: str
    name: str
    role: str
    key: str = attrs.field(repr=False)

    @classmethod
    def parse(cls, entry: str) -> ControlKey:
        parts = entry.strip().split(":", 3)
        if len(parts) != 4 or not all(parts):
            raise ValueError(
                f"a control-plane key is id:name:role:key, got {entry.split(':')[0]}:..."
            )
        key_id, name, role, key = parts
        role = role.lower()
        if role not in ROLES:
            raise ValueError(f"control-plane key {key_id}: role must be admin or user, not {role}")
        return cls(key_id, name, role, key)


def parse_keys(values: Sequence[str]) -> tuple[ControlKey, ...]:
    """Entries from repeated flags, each possibly a comma- or semicolon-separated list."""
    entries = [e for v in values for e in v.replace(";", ",").split(",") if e.strip()]
    return tuple(ControlKey.parse(e) for e in entries)
