"""Regenerates `sglang_router_0.3.2_flags.json`: every flag of SGLang's router, as parsed.

Run with the interpreter of an environment holding sglang-router 0.3.2 from PyPI (the bench's
peers environment has it: `make bench-peers` creates `bench/.peers`):

    bench/.peers/bin/python tests/data/dump_sglang_router_flags.py \\
        > tests/data/sglang_router_0.3.2_flags.json

It reads the argparse parser `python -m sglang_router.launch_router` builds
(`RouterArgs.add_cli_args(parser, use_router_prefix=False)`), so the list is the one its
`--help` prints.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json

from sglang_router.router_args import RouterArgs


def main() -> None:
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    flags = {}
    for action in parser._actions:
        if not action.option_strings or isinstance(action, argparse._HelpAction):
            continue
        flag = next(o for o in action.option_strings if o.startswith("--"))
        default = action.default
        if not isinstance(default, (int, float, str, bool, type(None), list)):
            default = dict(default) if isinstance(default, dict) else repr(default)
        flags[flag] = {
            "default": default,
            "choices": sorted(action.choices) if action.choices else None,
            "nargs": action.nargs,
            "type": getattr(action.type, "__name__", None),
            "switch": action.nargs == 0,
        }
    version = importlib.metadata.version("sglang-router")
    provenance = (
        f"sglang-router {version} from PyPI: the parser of `python -m sglang_router.launch_router`"
        " (tests/data/dump_sglang_router_flags.py)"
    )
    print(json.dumps({"provenance": provenance, "flags": flags}, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
