"""Small parsers of configuration values, shared by the flag table, the checks and the code that
reads the same values elsewhere (CORS answers, leg headers). Pure: no I/O."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from urllib.parse import urlsplit


def admin_port(value: str) -> int | None:
    """`--admin-port`: a port number, or `none` for no admin listener."""
    if value.lower() == "none":
        return None
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a port number or none, not {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port number (0-65535) or none, not {port}")
    return port


def not_bucket(name: str) -> str:
    """`--policy` and `--decode-policy` refuse bucket with a usage error saying why."""
    if name == "bucket":
        raise argparse.ArgumentTypeError(
            "bucket balances prefill workers by prompt length: use --prefill-policy bucket"
        )
    if name == "kv_aware":
        raise argparse.ArgumentTypeError(
            "kv_aware routes prefill by the engines' KV events: use --prefill-policy kv_aware"
        )
    return name


def usable_key(key: str | None) -> bool:
    """Whether a key can go into an `Authorization` header as it is (visible ASCII: a CR/LF
    would inject headers of its own). Keys are checked where they come in."""
    return key is None or all(0x21 <= ord(c) <= 0x7E for c in key)


def check_origins(origins: Sequence[str]) -> tuple[str, ...]:
    """The configured CORS origins, or ValueError for one that can never equal a browser's
    `Origin` (`scheme://host[:port]` in lowercase, nothing after it): such an entry would
    silently grant nothing, so it is a usage error.

    SMG 0.3.2 panics at startup on `*` in the list (tower-http refuses it); here it is a usage
    error naming the fix."""
    for origin in origins:
        if origin == "*":
            raise ValueError("'*' is not an origin: give no origins to allow any")
        if not origin or not origin.isascii() or not origin.isprintable() or " " in origin:
            raise ValueError(f"not an origin: {origin!r}")
        parts = urlsplit(origin)
        bare = f"{parts.scheme}://{parts.netloc}"
        if not parts.scheme or not parts.netloc or "@" in parts.netloc or origin != bare:
            raise ValueError(
                f"not an origin: {origin!r} (a browser sends scheme://host[:port], no path)"
            )
        if origin != origin.lower():
            raise ValueError(f"browsers send origins in lowercase: {origin.lower()!r}")
    return tuple(origins)


def duration_buckets(values: Sequence[float] | None) -> tuple[float, ...] | None:
    """Histogram bounds in increasing order, each once; NaN bounds nothing (ValueError)."""
    if values is None:
        return None
    if any(math.isnan(v) for v in values):
        raise ValueError("nan is not a bucket bound")
    return tuple(sorted(set(values)))


def comma_list(value: str) -> tuple[str, ...]:
    """A comma-separated list from the environment (`$TRIO_PD_DATA_PLANE_API_KEYS`)."""
    return tuple(item for item in value.split(",") if item)


def model_alias(value: str) -> tuple[str, str]:
    """One `--model-alias` value, `<alias>=<canonical>` (SMG 1.13's format; case-sensitive)."""
    alias, sep, canonical = value.partition("=")
    if not sep or not alias.strip() or not canonical.strip():
        raise ValueError(f"a model alias is <alias>=<canonical>, not {value!r}")
    return alias.strip(), canonical.strip()


def model_aliases(values: list[tuple[str, str]] | None) -> tuple[tuple[str, str], ...]:
    """Every `--model-alias` given (argparse appends them), in order; an alias named twice is
    refused (which model it meant would depend on the order)."""
    found = tuple(values or ())
    aliases = [alias for alias, _ in found]
    twice = sorted({a for a in aliases if aliases.count(a) > 1})
    if twice:
        raise ValueError(f"an alias names one model: {', '.join(twice)} given twice")
    return found
