"""`trio-pd serve`'s argparse parser, made from the flag table, and its config file.

Each row of `config/flags/` becomes one option (SGLang's router flags a PD router does not act
on, `config/compat.py`'s rows, a group of their own). `serve_config(argv)` returns the
RouterConfig: argv parsed, `--config FILE`'s settings under it, the environment where a row
names a variable, then `config/build.py` and its checks; any problem is a usage error.

The config file is TOML, as hypercorn's: one key per flag, named as the flag without its dashes
(`queue-size = 200` or `queue_size = 200`), a switch `true` to turn it on, a list for a flag that
takes several values, and for `prefill`/`decode` a list of workers, each a string or a list
(`prefill = ["http://10.0.0.1:30000 8998", ["http://10.0.0.2:30000", "none"]]`). The command
line wins over the file (its workers come after the file's).
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Sequence
from typing import Any

from trio_pd.config import compat
from trio_pd.config.build import build_config
from trio_pd.config.checks import ConfigError
from trio_pd.config.flags import BY_NAME, DECODE_WORKER, PREFILL_WORKER, SERVE_FLAGS, Flag
from trio_pd.config.router import RouterConfig
from trio_pd.upstream.urls import check_syntax


class PrefillAction(argparse.Action):
    """`--prefill URL [PORT|none] [model=NAME]`: a bootstrap port is optional, `none` means no
    port; `model=NAME` names the model the worker serves (else it is learned from the worker)."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        url, *rest = values
        model, rest = take_model(parser, option_string, rest)
        if len(rest) > 1:
            parser.error(f"{option_string} takes URL [PORT|none] [model=NAME]: {' '.join(values)}")
        port: int | None = None
        if rest and rest[0].lower() != "none":
            try:
                port = int(rest[0])
            except ValueError:
                parser.error(f"{option_string}: bootstrap port must be an int or none: {rest[0]}")
            if not 1 <= port <= 65535:  # as POST /workers and the membership file check it
                parser.error(f"{option_string}: bootstrap port must be in 1..65535: {port}")
        check_url(parser, url)
        items = list(getattr(namespace, self.dest, None) or [])
        items.append((url, port, model))
        setattr(namespace, self.dest, items)


class DecodeAction(argparse.Action):
    """`--decode URL [model=NAME]`."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        url, *rest = values
        model, rest = take_model(parser, option_string, rest)
        if rest:
            parser.error(f"{option_string} takes URL [model=NAME]: {' '.join(values)}")
        check_url(parser, url)
        items = list(getattr(namespace, self.dest, None) or [])
        items.append((url, model))
        setattr(namespace, self.dest, items)


def take_model(
    parser: argparse.ArgumentParser, option: str | None, rest: list[str]
) -> tuple[str | None, list[str]]:
    models = [v for v in rest if v.startswith("model=")]
    if len(models) > 1 or any(not m[6:] for m in models):
        parser.error(f"{option}: one model=NAME at most")
    return (models[0][6:] if models else None), [v for v in rest if not v.startswith("model=")]


def check_url(parser: argparse.ArgumentParser, url: str) -> None:
    try:
        check_syntax(url)
    except ValueError as exc:
        parser.error(str(exc))


ACTIONS: dict[str, type[argparse.Action] | str] = {
    PREFILL_WORKER: PrefillAction,
    DECODE_WORKER: DecodeAction,
    "extend": "extend",  # `trio-pd launch`'s repeatable lists (SMG 1.13)
}


def add_flag(group: Any, row: Flag, suppress: bool = False, aliases: Sequence[str] = ()) -> None:
    """One row as an argparse option (`suppress`: no default, so only given flags are set;
    `aliases`: its second spellings)."""
    kwargs: dict[str, Any] = {"help": row.help, "dest": row.dest}
    if row.switch:
        kwargs["action"] = "store_true"
    else:
        if row.action is not None:
            kwargs["action"] = ACTIONS[row.action]
        for name in ("type", "nargs", "choices", "metavar"):
            if getattr(row, name) is not None:
                kwargs[name] = getattr(row, name)
    default = False if row.switch and row.default is None else row.default
    kwargs["default"] = argparse.SUPPRESS if suppress else default
    group.add_argument(row.name, *aliases, **kwargs)


def add_foreign(
    group: Any, foreign: compat.Foreign, suppress: bool = False, aliases: Sequence[str] = ()
) -> None:
    kwargs = dict(foreign.kwargs)
    aliases = (*aliases, *kwargs.pop("aliases", ()))
    switch = kwargs.pop("switch", False)
    if switch == "optional":  # --x / --no-x (SMG's BooleanOptionalAction)
        kwargs.update(action=argparse.BooleanOptionalAction, default=None)
    elif switch:
        kwargs.update(action="store_true", default=False)
    else:
        kwargs.setdefault("metavar", foreign.flag[2:].replace("-", "_").upper())
    if suppress:
        kwargs["default"] = argparse.SUPPRESS
    group.add_argument(
        foreign.flag, *aliases, dest=foreign.dest, help=f"{foreign.status}: {foreign.why}",
        **kwargs,
    )  # fmt: skip


def add_serve_arguments(parser: argparse.ArgumentParser, suppress: bool = False) -> None:
    """Every row of the table, grouped as the table groups them, and `--config`."""
    parser.add_argument(
        "--config",
        metavar="FILE",
        default=argparse.SUPPRESS if suppress else None,
        help="read settings from this TOML file, one key per flag (the command line wins)",
    )
    groups: dict[str | None, Any] = {None: parser}
    for row in SERVE_FLAGS:
        if row.group not in groups:
            groups[row.group] = parser.add_argument_group(row.group)
        add_flag(groups[row.group], row, suppress)
    foreign = parser.add_argument_group(
        "SGLang router flags outside a PD router",
        "accepted for drop-in compatibility: ignored with a warning when ignoring them cannot "
        "change routing or security, refused with a message otherwise",
    )
    for foreign_row in compat.FOREIGN:
        add_foreign(foreign, foreign_row, suppress)


def given_flags(argv: Sequence[str]) -> list[str]:
    """The flags `argv` names, in order (parsed again with no defaults: abbreviations and
    `--flag=value` count as argparse counts them)."""
    quiet = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    add_serve_arguments(quiet, suppress=True)
    try:
        named, _ = quiet.parse_known_args(list(argv))
    except argparse.ArgumentError:
        return []
    names = {row.dest: row.name for row in SERVE_FLAGS}
    names.update({row.dest: row.flag for row in compat.FOREIGN})
    return [names[dest] for dest in vars(named) if dest in names]


def file_arguments(path: str) -> list[str]:
    """`--config FILE`'s settings as command-line tokens (they go before the command line's)."""
    try:
        with open(path, "rb") as file:
            settings = tomllib.load(file)
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"--config {path}: not TOML: {exc}") from None
    tokens: list[str] = []
    for key, value in settings.items():
        name = "--" + key.replace("_", "-")
        row = BY_NAME.get(name)
        if row is None and name not in compat.BY_FLAG:
            raise ConfigError(f"--config {path}: no flag {name} (key {key!r})")
        if (row is not None and row.switch) or isinstance(value, bool):
            tokens += [name] if value is True else []
        elif row is not None and row.action in (PREFILL_WORKER, DECODE_WORKER):
            for worker in value if isinstance(value, list) else [value]:
                parts = worker.split() if isinstance(worker, str) else [str(v) for v in worker]
                tokens += [name, *parts]
        elif isinstance(value, list):
            tokens += [name, *map(str, value)]
        else:
            tokens += [name, str(value)]
    return tokens


def serve_config(
    parser: argparse.ArgumentParser, argv: Sequence[str], args: argparse.Namespace
) -> RouterConfig:
    """The RouterConfig of a parsed `serve` command line (`argv` its own tokens, after `serve`);
    a usage error (exit 2, serve's usage) for anything the config refuses."""
    try:
        if args.config:
            tokens = [*file_arguments(args.config), *argv]
            args = parser.parse_args(tokens)
            argv = tokens
        return build_config(vars(args), given_flags(argv), os.environ)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits
