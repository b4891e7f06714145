"""`trio-pd launch`'s argparse parser: every flag of SMG 1.13.0's `smg launch`, and its config.

The parser is serve's (`cli/parser.py`) over launch's table (`config/flags/launch.py`: serve's
rows, with 1.13's meaning where it changed, SMG's second spellings and repeatable lists), plus
the SMG flags serve has no row for (`config/launch_compat.py`: ignored with a warning, or
refused with the reason). `launch_config` returns the RouterConfig; a problem is a usage error.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from typing import Any

import attrs

from trio_pd.cli.parser import add_flag, add_foreign, file_arguments
from trio_pd.config import compat
from trio_pd.config.checks import ConfigError
from trio_pd.config.flags import BY_NAME
from trio_pd.config.flags.launch import ALIASES, LAUNCH_FLAGS, REPEATABLE, WIDER_CHOICES
from trio_pd.config.launch_compat import build_launch_config, launch_foreign
from trio_pd.config.router import RouterConfig

LAUNCH_DESCRIPTION = (
    "Run the PD router. Takes every flag of SGLang's router today, SMG 1.13.0's `smg launch`, "
    "with SMG 1.13's meaning (where it differs from sglang-router 0.3.2's, `trio-pd serve` "
    "keeps 0.3.2's); docs/smg-1.13.md says, flag by flag, where trio_pd differs."
)


def serve_foreign_under_launch(foreign: compat.Foreign) -> compat.Foreign:
    """A serve foreign row with SMG 1.13's arity (wider choices, repeatable lists)."""
    kwargs = dict(foreign.kwargs)
    if foreign.flag in WIDER_CHOICES:
        kwargs["choices"] = list(WIDER_CHOICES[foreign.flag][0])
    if foreign.flag in REPEATABLE:
        kwargs["action"] = "extend"
    status = "`sglang`, `vllm` accepted, others refused" if foreign.flag == "--backend" else None
    return attrs.evolve(foreign, kwargs=kwargs, status=status or foreign.status)


def foreign_rows() -> tuple[compat.Foreign, ...]:
    return (
        *(serve_foreign_under_launch(f) for f in compat.FOREIGN),
        *launch_foreign(),
    )


def aliases(flag: str) -> tuple[str, ...]:
    """SMG's second spellings of `flag`, but a serve row's own name (it is that row)."""
    return tuple(alias for alias in ALIASES.get(flag, ()) if alias not in BY_NAME)


def add_launch_arguments(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Every row of launch's table, grouped as serve groups them, SMG's own flags, `--config`."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS if suppress else None,
        help="read settings from this TOML file, one key per serve flag (the command line wins)",
    )
    groups: dict[str | None, Any] = {None: parser}
    for row in LAUNCH_FLAGS:
        if row.group not in groups:
            groups[row.group] = parser.add_argument_group(row.group)
        add_flag(groups[row.group], row, suppress, aliases(row.name))
    foreign = parser.add_argument_group(
        "SMG flags outside a PD router",
        "accepted for drop-in compatibility with `smg launch`: ignored with a warning when "
        "ignoring them cannot change routing or security, refused with the reason otherwise",
    )
    for foreign_row in foreign_rows():
        add_foreign(foreign, foreign_row, suppress, aliases(foreign_row.flag))


def given_flags(argv: Sequence[str]) -> list[str]:
    """The flags `argv` names, in order, by their first spelling."""
    quiet = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_launch_arguments(quiet, suppress=True)
    try:
        named, _ = quiet.parse_known_args(list(argv))
    except argparse.ArgumentError:
        return []
    names = {row.dest: row.name for row in LAUNCH_FLAGS}
    names.update({row.dest: row.flag for row in foreign_rows()})
    return [names[dest] for dest in vars(named) if dest in names]


def launch_config(
    parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace
) -> RouterConfig:
    """The RouterConfig of a parsed `launch` command line (`argv` its tokens after `launch`);
    a usage error (exit 2) for anything refused."""
    try:
        if args.config:
            argv = [*file_arguments(args.config), *argv]
            args = parser.parse_args(argv)
        return build_launch_config(vars(args), given_flags(argv), os.environ)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
