"""Regenerates `smg_1.13.0_flags.json`: every flag of SMG's `smg launch`, as its parser holds it.

Run with the interpreter of an environment holding smg 1.13.0 from PyPI (its wheel carries the
Rust core, `smg.smg_rs`, which the parser asks for the parser names):

    /work/ref/smg-venv/bin/python tests/data/dump_smg_flags.py > tests/data/smg_1.13.0_flags.json

`smg launch ARGS` (smg/cli.py) hands ARGS to `smg.launch_router.parse_router_args`, which builds
an argparse parser with `RouterArgs.add_cli_args(parser, use_router_prefix=False)`: this reads
that parser, so the list is the one `smg launch --help` prints (about 1,250 lines), with each
flag's second spellings (`aliases`), its `--help` group, arity and help text. The examples of
that `--help` (its description) are kept too: tests/test_launch.py runs them.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
from pathlib import Path
from typing import Any

import smg.launch_router
from smg.launch_router import CustomHelpFormatter
from smg.router_args import RouterArgs


def arity(action: argparse.Action) -> str:
    """What the flag consumes, in argparse's words."""
    kind = type(action).__name__.strip("_").removesuffix("Action").lower()
    return {"storetrue": "switch", "booleanoptional": "switch"}.get(kind, kind)


def plain(value: Any) -> Any:
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return repr(value)


def main() -> None:
    parser = argparse.ArgumentParser(formatter_class=CustomHelpFormatter)
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    flags = {}
    for group in parser._action_groups:
        for action in group._group_actions:
            if isinstance(action, argparse._HelpAction):
                continue
            name, *aliases = action.option_strings
            flags[name] = {
                "aliases": aliases,
                "arity": arity(action),
                "nargs": action.nargs if not isinstance(action.nargs, int) or action.nargs else 0,
                "switch": arity(action) == "switch",
                "default": plain(action.default),
                "choices": [str(c) for c in action.choices] if action.choices else None,
                "type": getattr(action.type, "__name__", None),
                "help": action.help,
                "group": None if group.title in ("options", "optional arguments") else group.title,
            }
    source = Path(smg.launch_router.__file__).read_text()
    examples = source[source.index("Examples:") : source.index('""",', source.index("Examples:"))]
    provenance = (
        f"smg {importlib.metadata.version('smg')} from PyPI: the parser of `smg launch` "
        "(smg.launch_router.parse_router_args, RouterArgs.add_cli_args; "
        "tests/data/dump_smg_flags.py)"
    )
    print(
        json.dumps(
            {"provenance": provenance, "help_examples": examples, "flags": flags},
            indent=1,
            sort_keys=True,
        )
    )


if __name__ == "__main__":
    main()
