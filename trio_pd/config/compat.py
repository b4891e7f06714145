"""SGLang router flags that name features outside a PD router: accepted or refused, never unknown.

`trio-pd serve` takes every flag of `python -m sglang_router.launch_router` (sglang-router 0.3.2),
so a command line copied from SGLang's documentation starts trio_pd. Most flags are implemented
with SGLang's meaning (see `cli.py`); the ones here are not, and for each the rule is:

- **ignored with a warning** that names the flag, where ignoring it cannot change where a request
  goes or who may send it (the tokenizer, parsers, MCP and history flags only serve routes trio_pd
  does not have: `/v1/tokenize`, `/parse/*`, `/v1/responses`, `/v1/conversations`);
- **refused** with a message saying what to do instead, where ignoring it would change routing
  or security (regular, non-PD workers; the OpenAI backend; JWT/OIDC on the control plane).

A flag is only acted on when the command line names it: SGLang's defaults are trio_pd's too.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any

import attrs

NOT_SERVED = "trio_pd does not serve {routes}, which is all this flag configures in SGLang's router"


def _always(value: Any) -> bool:
    return True


def _never(value: Any) -> bool:
    return False


@attrs.frozen
class Foreign:
    """One SGLang flag trio_pd does not implement, parsed with SGLang's arity.

    `refuse(value)`: this value cannot be ignored safely (an error at start-up). `matches(value)`:
    this value asks for what trio_pd does anyway (accepted without a warning)."""

    flag: str
    why: str  # the warning or the error, without the flag's name
    status: str  # for --help and docs/flags.md: "ignored", "refused", ...
    refuse: Callable[[Any], bool] = _never
    matches: Callable[[Any], bool] = _never
    kwargs: dict[str, Any] = attrs.field(factory=dict)  # argparse arity: nargs, type, choices

    @property
    def dest(self) -> str:
        return "foreign_" + self.flag[2:].replace("-", "_")


def _ignored(flags: Sequence[str], why: str, **kwargs: Any) -> list[Foreign]:
    return [Foreign(flag, why, "ignored", kwargs=kwargs) for flag in flags]


TOKENIZER = NOT_SERVED.format(routes="/v1/tokenize, /v1/detokenize or gRPC workers") + (
    " (its HTTP PD router routes on the request text, as trio_pd does)"
)
PARSERS = NOT_SERVED.format(routes="/parse/function_call, /parse/reasoning or gRPC workers") + (
    "; tool calls and reasoning reach the client exactly as the engine wrote them"
)
HISTORY = NOT_SERVED.format(routes="/v1/responses or /v1/conversations")

FOREIGN: tuple[Foreign, ...] = (
    Foreign(
        "--worker-urls",
        "trio_pd routes prefill/decode pairs only: give the workers as --prefill URL [PORT] and "
        "--decode URL (SGLang's regular, non-PD mode is not supported)",
        "refused unless empty",
        refuse=bool,
        matches=lambda urls: not urls,
        kwargs={"nargs": "*", "default": [], "metavar": "URL"},
    ),
    Foreign(
        "--backend",
        "only the sglang backend is supported: trio_pd routes to SGLang PD engines, not to an "
        "OpenAI-compatible upstream",
        "`sglang` accepted, `openai` refused",
        refuse=lambda backend: backend != "sglang",
        matches=lambda backend: backend == "sglang",
        kwargs={"default": "sglang", "choices": ["sglang", "openai"]},
    ),
    *(
        Foreign(
            flag,
            "JWT/OIDC control-plane authentication is not supported: use "
            "--control-plane-api-keys (ignoring it would leave the control plane open)",
            "refused",
            refuse=_always,
            kwargs=kwargs,
        )
        for flag, kwargs in (
            ("--jwt-issuer", {}),
            ("--jwt-audience", {}),
            ("--jwt-jwks-uri", {}),
            ("--jwt-role-mapping", {"nargs": "*", "default": []}),
        )
    ),
    *_ignored(["--model-path", "--tokenizer-path", "--chat-template"], TOKENIZER),
    *_ignored(
        ["--tokenizer-cache-enable-l0", "--tokenizer-cache-enable-l1"], TOKENIZER, switch=True
    ),
    *_ignored(["--tokenizer-cache-l0-max-entries"], TOKENIZER, type=int, default=10000),
    *_ignored(["--tokenizer-cache-l1-max-memory"], TOKENIZER, type=int, default=52428800),
    *_ignored(["--reasoning-parser", "--tool-call-parser"], PARSERS),
    *_ignored(["--mcp-config-path"], NOT_SERVED.format(routes="/v1/responses (MCP tool loops)")),
    *_ignored(
        ["--history-backend"],
        HISTORY,
        default="memory",
        choices=["memory", "none", "oracle", "postgres", "redis"],
    ),
    *_ignored(
        [
            "--oracle-wallet-path",
            "--oracle-tns-alias",
            "--oracle-connect-descriptor",
            "--oracle-username",
            "--oracle-password",
            "--postgres-db-url",
            "--redis-url",
        ],
        HISTORY,
    ),
    *_ignored(["--oracle-pool-min"], HISTORY, type=int, default=1),
    *_ignored(
        ["--oracle-pool-max", "--postgres-pool-max", "--redis-pool-max"],
        HISTORY,
        type=int,
        default=16,
    ),
    *_ignored(
        ["--oracle-pool-timeout-secs", "--redis-retention-days"], HISTORY, type=int, default=30
    ),
)

BY_FLAG = {f.flag: f for f in FOREIGN}


class _Given(argparse.Action):
    """Stores the value like argparse would, and notes that the command line named the flag."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        setattr(namespace, self.dest, True if self.nargs == 0 else values)
        given = list(getattr(namespace, "foreign_given", None) or [])
        given.append(self.option_strings[0])
        namespace.foreign_given = given


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """SGLang's flags trio_pd does not implement, in a group of their own in `--help`."""
    group = parser.add_argument_group(
        "SGLang router flags outside a PD router",
        "accepted for drop-in compatibility: ignored with a warning when ignoring them cannot "
        "change routing or security, refused with a message otherwise",
    )
    for foreign in FOREIGN:
        kwargs = dict(foreign.kwargs)
        if kwargs.pop("switch", False):
            kwargs.update(nargs=0, default=False)
        else:
            kwargs.setdefault("metavar", foreign.flag[2:].replace("-", "_").upper())
        group.add_argument(
            foreign.flag,
            action=_Given,
            dest=foreign.dest,
            help=f"{foreign.status}: {foreign.why}",
            **kwargs,
        )
    parser.set_defaults(foreign_given=[])


def check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the foreign flags this command line names."""
    errors: list[str] = []
    warnings: list[str] = []
    for flag in dict.fromkeys(args.foreign_given):  # once per flag, in order
        foreign = BY_FLAG[flag]
        value = getattr(args, foreign.dest)
        if foreign.refuse(value):
            errors.append(f"{flag}: {foreign.why}")
        elif not foreign.matches(value):
            warnings.append(f"{flag} is ignored: {foreign.why}")
    return errors, warnings


# Implemented flags whose meaning in trio_pd is wider or stricter than in SGLang's router: the
# flag table of docs/flags.md shows these notes (tests/flag_surface.py), and a default that
# differs from SGLang's must have one (tests/test_flag_surface.py).
DIFFERS: dict[str, str] = {
    "--prefill": "also takes `model=NAME`, the model the worker serves (else learned from it)",
    "--decode": "also takes `model=NAME`",
    "--pd-disaggregation": "without it SGLang's router serves regular workers; trio_pd has no "
    "such mode",
    "--mini-lb": "SGLang starts a separate debugging router; trio_pd keeps its own (health, "
    "breakers, retries, aborts) and takes MiniLB's one routing rule",
    "--enable-igw": "no effect: SGLang's router ignores a request's `model` without it; "
    "trio_pd always honours it",
    "--api-key": "`--data-plane-api-keys` adds more client keys beside it; from the flag or "
    "`$TRIO_PD_API_KEY`, it must be visible ASCII",
    "--control-plane-api-keys": "without them and without `--api-key`, the changing routes "
    "are served on the admin listener only (`--admin-port`), never on this port (SGLang's are "
    "open to anyone who reaches the port); with keys they are needed on both; a key must be "
    "visible ASCII",
    "--log-level": "`warning` and `critical` (Python's names) are accepted too",
    "--log-dir": "a directory that cannot be created or written stops the start-up with the "
    "reason (SGLang's router then logs nowhere): logs asked for must not be lost silently",
    "--prometheus-port": "`0` takes any free port; a taken port stops the start-up with the "
    "reason, as SGLang's router does by panicking",
    "--max-concurrent-requests": "a cap that always holds, as SGLang documents it: SMG 0.3.2 "
    "admits on a token bucket whose refill lets more in every second while earlier requests "
    "still run",
    "--rate-limit-tokens-per-second": "a rate limit beside the cap (a spent token is not given "
    "back); without it or with 0, the cap alone. SMG 0.3.2 gives tokens back and refills at "
    "this rate (default N), which only loosens its cap",
    "--prefill-policy": "`bucket` takes only candidates (healthy, breaker allowing), and a "
    "membership change recomputes its ranges (SGLang's may route to a worker that is out)",
    "--policy": "`manual` keeps at most 262144 routing keys (least recently used dropped "
    "first); SGLang bounds them by idle time only",
}
