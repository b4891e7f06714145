"""SGLang router flags that name features outside a PD router: accepted or refused, never unknown.

`trio-pd serve` takes every flag of `python -m sglang_router.launch_router` (sglang-router 0.3.2),
so a command line copied from SGLang's documentation starts trio_pd. Most flags are implemented
with SGLang's meaning (`config/flags/`); the ones here are not, and for each the rule is:

- **ignored with a warning** that names the flag, where ignoring it cannot change where a request
  goes or who may send it (the tokenizer, parsers, MCP and history flags only serve routes trio_pd
  does not have: `/v1/tokenize`, `/parse/*`, `/v1/responses`, `/v1/conversations`);
- **refused** with a message saying what to do instead, where ignoring it would change routing
  or security (regular, non-PD workers; the OpenAI backend; JWT/OIDC on the control plane).

A flag is only acted on when the command line names it: SGLang's defaults are trio_pd's too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
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
        "only the sglang and vllm backends are supported: trio_pd routes to PD engines, not to "
        "an OpenAI-compatible upstream (`vllm`, SMG's shape, is --vllm-pd-disaggregation)",
        "`sglang`, `vllm` accepted, `openai` refused",
        refuse=lambda backend: backend not in ("sglang", "vllm"),
        matches=lambda backend: backend in ("sglang", "vllm"),
        kwargs={"default": "sglang", "choices": ["sglang", "vllm", "openai"]},
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
    *_ignored(["--model-path", "--chat-template"], TOKENIZER),
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


def check_values(
    values: Mapping[str, Any], given: Collection[str], rows: Mapping[str, Foreign] | None = None
) -> tuple[list[str], list[str]]:
    """(errors, warnings) for the foreign flags a command line names (`given`, in order);
    `values` holds their parsed values by `Foreign.dest`; `rows`: these rows (default FOREIGN's,
    `trio-pd launch` passes its own)."""
    rows = BY_FLAG if rows is None else rows
    errors: list[str] = []
    warnings: list[str] = []
    for flag in dict.fromkeys(f for f in given if f in rows):  # once per flag, in order
        foreign = rows[flag]
        value = values.get(foreign.dest)
        if foreign.refuse(value):
            errors.append(f"{flag}: {foreign.why}")
        elif not foreign.matches(value):
            warnings.append(f"{flag} is ignored: {foreign.why}")
    return errors, warnings
