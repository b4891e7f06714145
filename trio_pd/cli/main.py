"""`trio-pd serve | launch`: the commands, and the RouterConfig a line asks for.

`serve` takes every flag of SGLang's router (sglang-router 0.3.2) with its name, arity and
default; `launch` every flag of `smg launch` (SMG 1.13.0, `cli/launch.py`) with 1.13's meaning.
The flags are declared once, in the flag table (`config/flags/`), from which `cli/parser.py`
makes the parser and `config/build.py` the config. The simulator and the demo are another
distribution's command (`trio-pd-testing engine | demo`, `testing/`): the router imports none of
it and its wheel ships none (tests/test_cli.py checks both).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trio_pd.cli.launch import LAUNCH_DESCRIPTION, add_launch_arguments, launch_config
from trio_pd.cli.parser import add_serve_arguments, serve_config
from trio_pd.config.router import RouterConfig
from trio_pd.membership.private_file import UnsafeFile, check_private

SERVE_DESCRIPTION = (
    "Run the PD router. Takes every flag of SGLang's router (python -m "
    "sglang_router.launch_router, sglang-router 0.3.2) with the same meaning; docs/flags.md "
    "says where trio_pd differs."
)


class Parser(argparse.ArgumentParser):
    """Remembers the tokens of its `serve` or `launch` command on the namespace (`_serve_argv`):
    which flags the command line named decides whether the environment or a warning applies."""

    def parse_known_args(self, args=None, namespace=None):
        tokens = list(sys.argv[1:] if args is None else args)
        parsed, rest = super().parse_known_args(tokens, namespace)
        command = getattr(parsed, "command", None)
        if command in ("serve", "launch"):
            parsed._serve_argv = tokens[tokens.index(command) + 1 :]
        return parsed, rest


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="trio-pd", description="Prefill/decode disaggregated LLM router on trio.")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the PD router",
        description=SERVE_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_serve_arguments(serve)
    serve.set_defaults(serve_parser=serve)
    launch = commands.add_parser(
        "launch",
        help="run the PD router, as `smg launch` (SMG 1.13.0)",
        description=LAUNCH_DESCRIPTION,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add_launch_arguments(launch)
    launch.set_defaults(serve_parser=launch)
    return parser


def router_config(args: argparse.Namespace) -> RouterConfig:
    """The RouterConfig of a parsed `trio-pd serve|launch ...` (a usage error for a refused one)."""
    parser: Any = args.serve_parser
    build = launch_config if args.command == "launch" else serve_config
    config = build(parser, getattr(args, "_serve_argv", []), args)
    files = [config.membership_file]
    if config.discovery_provider == "file":
        files.append(config.discovery_file)
    for name in files:  # a file another user can write names the workers: refused now
        if name:
            try:
                check_private(Path(name))
            except UnsafeFile as exc:
                parser.error(str(exc))
    if config.kubernetes is not None:  # the environment it needs: now, not after startup
        from trio_pd.membership import kubernetes

        try:
            kubernetes.ssl_context(kubernetes.resolve_endpoint(config.kubernetes, os.environ))
        except ValueError as exc:
            parser.error(f"service discovery: {exc}")
    return config


def main(argv: Sequence[str] | None = None) -> None:
    tokens = list(sys.argv[1:] if argv is None else argv)
    if tokens[:1] in (["engine"], ["demo"]):  # the commands that moved: say where to
        raise SystemExit(f"trio-pd: `{tokens[0]}` is `trio-pd-testing {tokens[0]}` now (testing/)")
    args = build_parser().parse_args(tokens)
    from trio_pd.serve.run import run

    raise SystemExit(run(router_config(args)))
