"""SGLang's router flags beside `trio-pd serve`'s, and the docs/flags.md tables made from them.

`python -m tests.flag_surface` rewrites docs/flags.md's two flag tables (between their markers);
`tests/test_flag_surface.py` fails while they are not what this prints.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trio_pd.cli.main import build_parser
from trio_pd.config import compat
from trio_pd.config.flags import BY_NAME

ROOT = Path(__file__).resolve().parent.parent
SGLANG_FLAGS = ROOT / "tests" / "data" / "sglang_router_0.3.2_flags.json"
FLAGS_PAGE = ROOT / "docs" / "flags.md"
MARKERS = {
    "sglang": ("<!-- flag table: SGLang's flags (tests/flag_surface.py) -->", "<!-- end -->"),
    "ours": ("<!-- flag table: trio_pd's own flags (tests/flag_surface.py) -->", "<!-- end -->"),
}


def sglang_flags() -> dict[str, dict[str, Any]]:
    return json.loads(SGLANG_FLAGS.read_text())["flags"]


def serve_parser() -> argparse.ArgumentParser:
    subparsers = next(
        a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    return subparsers.choices["serve"]


def serve_actions() -> dict[str, argparse.Action]:
    """`trio-pd serve`'s options by their long name (`--help` excluded)."""
    actions = {}
    for action in serve_parser()._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        for option in action.option_strings:
            if option.startswith("--"):
                actions[option] = action
    return actions


def same_default(ours: Any, theirs: Any) -> bool:
    """Defaults that mean the same: an empty list, dict or None are all "nothing given"."""
    if isinstance(ours, tuple):
        ours = list(ours)
    if ours in (None, [], {}) and theirs in (None, [], {}):
        return True
    if isinstance(ours, (int, float)) and isinstance(theirs, (int, float)):
        if isinstance(ours, bool) or isinstance(theirs, bool):
            return ours is theirs
        return float(ours) == float(theirs)
    return ours == theirs


def shown(value: Any) -> str:
    if value in (None, [], {}, False):
        return ""
    if value is True:
        return "on"
    if isinstance(value, list):
        value = " ".join(map(str, value))
    return f"`{value}`"


def treatment(flag: str) -> str:
    foreign = compat.BY_FLAG.get(flag)
    return foreign.status if foreign is not None else "implemented"


def meaning(flag: str, action: argparse.Action) -> str:
    foreign = compat.BY_FLAG.get(flag)
    if foreign is not None:
        return foreign.why
    help_text = (action.help or "").replace("%%", "%")
    row = BY_NAME.get(flag)
    differs = row.differs if row is not None else None
    return f"{help_text}. **Differs:** {differs}" if differs else help_text


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def sglang_table() -> str:
    actions = serve_actions()
    rows = [
        "| flag | SGLang default | trio_pd | as in SGLang's router / differs (why) |",
        "|---|---|---|---|",
    ]
    for flag, spec in sorted(sglang_flags().items()):
        action = actions[flag]
        default = shown(spec["default"])
        if not same_default(action.default, spec["default"]) and flag not in compat.BY_FLAG:
            default += f" (trio_pd: {shown(action.default) or 'none'})"
        rows.append(
            f"| `{flag}` | {cell(default)} | {treatment(flag)} | {cell(meaning(flag, action))} |"
        )
    return "\n".join(rows)


def ours_table() -> str:
    theirs = sglang_flags()
    rows = ["| flag | default | meaning |", "|---|---|---|"]
    for flag, action in sorted(serve_actions().items()):
        if flag in theirs:
            continue
        help_text = (action.help or "").replace("%%", "%")
        rows.append(f"| `{flag}` | {cell(shown(action.default))} | {cell(help_text)} |")
    return "\n".join(rows)


TABLES = {"sglang": sglang_table, "ours": ours_table}


def page_section(text: str, which: str) -> str:
    start, end = MARKERS[which]
    begin = text.index(start) + len(start)
    return text[begin : text.index(end, begin)].strip("\n")


def rewrite_page() -> None:
    text = FLAGS_PAGE.read_text()
    for which, table in TABLES.items():
        start, end = MARKERS[which]
        begin = text.index(start) + len(start)
        finish = text.index(end, begin)
        text = text[:begin] + "\n" + table() + "\n" + text[finish:]
    FLAGS_PAGE.write_text(text)


if __name__ == "__main__":
    rewrite_page()
    sys.stdout.write("docs/flags.md flag tables rewritten\n")
