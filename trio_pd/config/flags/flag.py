"""One flag of `trio-pd serve`, declared once: the row every other view is made from.

A `Flag` holds what argparse needs (its arity, type, choices, default, help), where its value
goes (`field`: a dotted path into `RouterConfig`, e.g. `retry.max_retries`), how it gets there
(`convert`, `invert` for the switches that turn something off, `env` for a value that may come
from the environment), and what it is beside SGLang's router (`differs`: why trio_pd's meaning
is wider or stricter). `cli/parser.py` builds the parser from the table, `config/build.py` the
RouterConfig from the parsed values, `tests/flag_surface.py` the docs' flag tables; checks of
the finished config are `config/checks.py`'s. Adding a flag is adding one row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

# The switches argparse knows: a row with one of these takes no value.
SWITCH = "store_true"


@attrs.frozen
class Flag:
    name: str  # "--queue-size"
    help: str
    field: str | None = None  # RouterConfig path; None: read by build.py itself (workers, ...)
    default: Any = None  # the command line's default (may differ from RouterConfig's own)
    type: Callable[[str], Any] | None = None
    nargs: str | int | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | tuple[str, ...] | None = None
    action: str | None = None  # SWITCH, or a name `cli/parser.py` maps to its own action
    convert: Callable[[Any], Any] | None = None  # the parsed value -> the field's value
    invert: bool = False  # a switch that turns `field` off (--disable-retries)
    env: str | None = None  # read from this environment variable when the flag is not given
    enables: str | None = None  # a true value makes this optional sub-config (kubernetes, etcd)
    group: str | None = None  # its --help group (None: the main one)
    differs: str | None = None  # where trio_pd's meaning differs from SGLang's router, and why

    @property
    def dest(self) -> str:
        """The argparse destination: the flag's name as an identifier."""
        return self.name[2:].replace("-", "_")

    @property
    def switch(self) -> bool:
        return self.action == SWITCH


def by_name(flags: tuple[Flag, ...]) -> dict[str, Flag]:
    found: dict[str, Flag] = {}
    for flag in flags:
        if flag.name in found:
            raise ValueError(f"{flag.name} is declared twice")
        found[flag.name] = flag
    return found
