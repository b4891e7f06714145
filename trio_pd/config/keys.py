"""Control-plane keys (`--control-plane-api-keys 'id:name:role:key'`) as configuration values.

The syntax, as SGLang's router takes it plus lists: each argument holds one entry
`id:name:role:key`, split at its first three colons (the key may hold colons), or several such
entries joined by `,` or `;`. A `,` or `;` separates two entries only where what follows it
reads as the start of the next one, `id:name:admin:` or `id:name:user:` (an id and a name
without `:`, `,` or `;`); anywhere else it is part of the key. So a key may hold `,` and `;`
(`k1:ops:admin:a,b;c` is one key, `a,b;c`), and a list from one environment variable still
works (`k1:ops:admin:x,k2:ci:user:y`). Only a key that itself holds `,id:name:role:` is cut.

Errors name the entry by its position, never by its text: a mistyped entry (fields out of
order) may have the secret anywhere in it. A key must be visible ASCII (it is compared with a
header's value: a space, CR or LF in it could never match, or would end up in logs of tools
that print headers).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import attrs

KEY_ROLES = ("admin", "user")  # a control-plane key's roles (a worker's are spec.ROLES)
# Where a list of entries is cut: a `,` or `;` followed by the start of the next entry.
NEXT_ENTRY = re.compile(r"[,;](?=[^:,;]+:[^:,;]+:(?i:admin|user):)")


def visible_ascii(text: str) -> bool:
    """Every character printable ASCII, no space (what a key in a header may hold)."""
    return all(0x21 <= ord(c) <= 0x7E for c in text)


@attrs.frozen
class ControlKey:
    """One `--control-plane-api-keys` entry: `id:name:role:key` (the key may hold colons)."""

    id: str
    name: str
    role: str
    key: str = attrs.field(repr=False)

    @classmethod
    def parse(cls, entry: str, position: int = 1) -> ControlKey:
        """One entry; ValueError naming it by `position` (its text may hold the secret)."""
        parts = entry.strip().split(":", 3)
        if len(parts) != 4:
            raise ValueError(
                f"entry {position} is not id:name:role:key (not shown: it holds a key)"
            )
        key_id, name, role, key = (part.strip() for part in parts)
        if not all((key_id, name, role, key)):
            raise ValueError(f"entry {position}: id, name, role and key must all be non-empty")
        role = role.lower()
        if role not in KEY_ROLES:
            raise ValueError(f"entry {position}: the role (third field) must be admin or user")
        if not visible_ascii(key):
            raise ValueError(
                f"entry {position}: the key must be visible ASCII (no spaces or control characters)"
            )
        return cls(key_id, name, role, key)


def split_entries(value: str) -> list[str]:
    """One argument's entries (see the module docstring)."""
    return [entry for entry in NEXT_ENTRY.split(value) if entry.strip()]


def parse_keys(values: Sequence[str]) -> tuple[ControlKey, ...]:
    """Entries from repeated flags, each argument one entry or a `,`/`;` list of them."""
    entries = [entry for value in values for entry in split_entries(value)]
    return tuple(ControlKey.parse(entry, n) for n, entry in enumerate(entries, 1))
