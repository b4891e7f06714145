"""SMG 1.13.0's `smg launch` flags beside `trio-pd launch`'s, and docs/smg-1.13.md's table.

`python -m tests.launch_surface` rewrites the table of docs/smg-1.13.md (between its markers);
`tests/test_launch.py` fails while it is not what this prints. Every flag of the checked-in list
(tests/data/smg_1.13.0_flags.json, `tests/data/dump_smg_flags.py`) gets one `treatment`:
implemented (serve's row, as in SMG or differing, and why), ignored or refused (why). A flag
with no treatment is an error, not a row.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from tests.flag_surface import cell, same_default, shown
from trio_pd.cli.launch import foreign_rows
from trio_pd.cli.main import build_parser
from trio_pd.config.flags import BY_NAME
from trio_pd.config.flags.launch import ALIASES, FOLLOWS_1_13, LAUNCH_FLAGS

ROOT = Path(__file__).resolve().parent.parent
SMG_FLAGS = ROOT / "tests" / "data" / "smg_1.13.0_flags.json"
PAGE = ROOT / "docs" / "smg-1.13.md"
MARKERS = ("<!-- flag table: SMG 1.13.0's flags (tests/launch_surface.py) -->", "<!-- end -->")


def smg_list() -> dict[str, Any]:
    return json.loads(SMG_FLAGS.read_text())


def smg_flags() -> dict[str, dict[str, Any]]:
    return smg_list()["flags"]


def launch_parser() -> argparse.ArgumentParser:
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return subparsers.choices["launch"]


def launch_actions() -> dict[str, argparse.Action]:
    """`trio-pd launch`'s options by every long spelling (`--help` excluded)."""
    actions = {}
    for action in launch_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option] = action
    return actions


AS_1_13 = "as in SMG 1.13 (serve: 0.3.2's)"


class Unclassified(LookupError):
    """An SMG flag trio_pd neither implements, nor ignores, nor refuses."""


def treatment(flag: str) -> tuple[str, str]:
    """(what `trio-pd launch` does with an SMG 1.13 flag, why or how)."""
    foreign = {row.flag: row for row in foreign_rows()}
    row = {row.name: row for row in LAUNCH_FLAGS}.get(flag)
    if row is not None:
        help_text = (row.help or "").replace("%%", "%")
        if row.differs:
            return "differs", f"{help_text}. **Differs:** {row.differs}"
        if flag in FOLLOWS_1_13:
            return AS_1_13, f"{help_text}. **As SMG 1.13:** {FOLLOWS_1_13[flag]}"
        return "as in SMG", help_text
    if flag in foreign:
        return foreign[flag].status, foreign[flag].why
    raise Unclassified(flag)


def smg_table() -> str:
    actions = launch_actions()
    rows = [
        "| flag | SMG 1.13 default | trio-pd launch "
        "| as in SMG / differs (why) / ignored / refused (why) |",
        "|---|---|---|---|",
    ]
    for flag, spec in sorted(smg_flags().items()):
        status, why = treatment(flag)
        names = ", ".join(f"`{name}`" for name in [flag, *spec["aliases"]])
        default = shown(spec["default"])
        ours = actions[flag].default
        if row_is_ours(flag) and not same_default(ours, spec["default"]):
            default += f" (trio_pd: {shown(ours) or 'none'})"
        rows.append(f"| {names} | {cell(default)} | {status} | {cell(why)} |")
    return "\n".join(rows)


def row_is_ours(flag: str) -> bool:
    return flag in BY_NAME


def page_section(text: str) -> str:
    start, end = MARKERS
    begin = text.index(start) + len(start)
    return text[begin : text.index(end, begin)].strip("\n")


def rewrite_page() -> None:
    text = PAGE.read_text()
    start, end = MARKERS
    begin = text.index(start) + len(start)
    finish = text.index(end, begin)
    PAGE.write_text(text[:begin] + "\n" + smg_table() + "\n" + text[finish:])


__all__ = ["ALIASES", "Unclassified", "launch_actions", "smg_flags", "smg_list", "treatment"]

if __name__ == "__main__":
    rewrite_page()
    sys.stdout.write("docs/smg-1.13.md flag table rewritten\n")
