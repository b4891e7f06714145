"""The flag table of `trio-pd launch`: serve's rows, with SMG 1.13.0's meaning where it changed.

`trio-pd launch` is a drop-in for `smg launch` (SMG 1.13.0), as `serve` is for sglang-router
0.3.2's `launch_router`. Both take the same rows (`SERVE_FLAGS`); where 1.13 gives a flag
another meaning or default, `serve` keeps 0.3.2's and `launch` takes 1.13's (`FOLLOWS_1_13`
says which and how, `LAUNCH_DIFFERS` where launch's meaning is not 1.13's either, and
`LAUNCH_FLAGS` is the table with those rows changed). SMG's second
spellings (`ALIASES`), its repeatable list flags (`REPEATABLE`: each occurrence adds, as SMG's
`extend`) and its wider choices (`WIDER_CHOICES`, refused with a reason where trio_pd has no
such policy) are launch's too. SMG flags serve has no row for are `config/launch_compat.py`'s.
"""

from __future__ import annotations

import os
from typing import Any

import attrs

from trio_pd.config.flags import SERVE_FLAGS, Flag
from trio_pd.config.flags.fleet import PANIC_ROUTING
from trio_pd.config.router import POLICY_NAMES

# SMG 1.13's second spellings of flags serve has (smg/router_args.py `add_cli_args`); one that
# is a row's own name is that row's, not an alias (`cli/launch.py` skips it).
ALIASES: dict[str, tuple[str, ...]] = {
    "--cache-threshold": ("--cache-match-threshold",),
    "--balance-abs-threshold": ("--spill-abs-threshold",),
    "--balance-rel-threshold": ("--spill-rel-threshold",),
    "--max-idle-secs": ("--sticky-key-idle-secs",),
    "--model-path": ("--model",),
    "--routing-key-override": ("--sticky-sessions",),
    # Pending serve rows (`config/launch_compat.py`), once they land:
    "--remove-unhealthy-workers": ("--worker-auto-recovery",),
}
# List flags SMG 1.13 accumulates over occurrences (argparse `extend`); 0.3.2 kept the last.
REPEATABLE: frozenset[str] = frozenset(
    {
        "--selector", "--prefill-selector", "--decode-selector", "--prometheus-duration-buckets",
        "--request-id-headers", "--cors-allowed-origins", "--ca-cert-paths",
        "--control-plane-api-keys", "--worker-urls", "--jwt-role-mapping",
        "--routing-key-headers",
    }
)  # fmt: skip
SMG_POLICIES = (
    "random", "round_robin", "passthrough", "cache_aware", "power_of_two", "least_load",
    "manual", "consistent_hashing", "prefix_hash",
)  # fmt: skip
POLICY_WHY = (
    f"is not a policy of trio_pd ({', '.join(POLICY_NAMES)}; bucket for prefill); "
    "`passthrough`, SMG's single-worker policy, is round_robin with one worker"
)
# Choices SMG 1.13 takes beyond the serve row's: parsed, then refused with this reason.
WIDER_CHOICES: dict[str, tuple[tuple[str, ...], str]] = {
    "--policy": (SMG_POLICIES, POLICY_WHY),
    "--prefill-policy": ((*SMG_POLICIES, "bucket"), POLICY_WHY),
    "--decode-policy": (SMG_POLICIES, POLICY_WHY),
    "--backend": (("sglang", "openai", "anthropic", "vllm", "tokenspeed"), ""),
}

PER_CORE, FLOOR = 1024, 4096  # SMG 1.13: model_gateway/src/app_context.rs


def available_cores() -> int:
    """The cores this process may run on (SMG reads `available_parallelism()`)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def smg_concurrency(value: int) -> int:
    """SMG 1.13's `--max-concurrent-requests`: -1 derives the cap from the host (1024 per
    core, at least 4096), 0 turns it off (serve's -1), N is N."""
    if value < 0:
        return max(PER_CORE * available_cores(), FLOOR)
    return -1 if value == 0 else value


# Flags whose 1.13 meaning or default differs from 0.3.2's: launch takes 1.13's (serve 0.3.2's).
FOLLOWS_1_13: dict[str, str] = {
    "--max-concurrent-requests": "-1 (the default) is a cap of 1024 per available core, at "
    "least 4096, and 0 is no cap; under serve (0.3.2) -1 is no cap",
    "--prometheus-host": "no default: the unspecified address of --host's family (:: for an "
    "IPv6 --host, else 0.0.0.0); under serve 0.0.0.0",
    "--cors-allowed-origins": "without it (or with none listed) no origin is allowed, and `*` "
    "allows any; under serve (0.3.2) no origins means any origin and `*` is refused",
    "--assignment-mode": "no default (random for manual, delegate for --routing-key-override) "
    "and the mode delegate, as 1.13's; under serve the same (0.3.2: random, and no delegate)",
    "--rate-limit-tokens-per-second": "a sustained admission rate beside the cap, as 1.13's; "
    "under serve the same, where 0.3.2 gave tokens back and refilled at N a second",
    **{flag: "each occurrence adds, as 1.13's; under serve the last one wins (0.3.2)"
       for flag in sorted(REPEATABLE)},
}  # fmt: skip
# Where launch's meaning is not SMG 1.13's either, and why.
LAUNCH_DIFFERS: dict[str, str] = {
    "--policy": "SMG 1.13's passthrough is refused with the reason (round_robin is the same "
    "with one worker); consistent_hashing does not read X-SMG-Target-Worker and prefix_hash "
    "does not hash at --cache-boundaries",
    "--least-load-max-waiting-requests": "when every candidate is at the cap they all stay "
    "candidates (SMG 1.13 holds the request in its admission queue; trio_pd has none there)",
    "--prefill-policy": "as --policy (passthrough refused with the reason)",
    "--decode-policy": "as --policy (passthrough refused with the reason)",
    "--sse-keepalive-secs": "a stream's headers wait for decode's first event (a failed prefill "
    "gets its real status) until the first keep-alive sends them; SMG sends them at once. "
    "Fractions of a second are taken",
    "--health-check-port": "served on the process's own event loop (SMG: an OS thread of its "
    "own): its own socket and connections, not its own CPU",
    "--model-alias": "no vendor contract profiles (kimi-*, minimax-*): an alias only routes",
    "--remove-unhealthy-workers": "what is removed is a worker given up at start-up; one that "
    "went down after passing is probed on and rejoins in place (SMG removes its Failed ones)",
    "--discovery-file": "a manifest record's kv_connector, kv_role and kv_engine_id are "
    "accepted and not acted on (a SGLang pair transfers KV by its own backend)",
    "--backend": "SMG 1.13 adds anthropic and tokenspeed: refused, as openai",
    "--balance-abs-threshold": "SMG 1.13 made the two thresholds one spill gate (a worker's "
    "load above the fleet's mean by both); trio_pd's cache_aware keeps SGLang 0.3.2's rule "
    "(the gap between the busiest and the idlest worker), its tree and its defaults",
    "--balance-rel-threshold": "as --balance-abs-threshold: SGLang 0.3.2's balance rule",
    # Engine-aware admission (docs/overload.md).
    "--worker-overload-waiting-requests": "on a PD decode, requests waiting for their KV cache "
    "(the prealloc and transfer queues of /v1/loads' disaggregation section) are not counted: "
    "every PD request waits there while its prefill runs, and SMG 1.13's count of them vetoes "
    "(or with --worker-overload-shed sheds) healthy decodes under ordinary load",
    "--cb-failure-threshold": PANIC_ROUTING,
    "--pd-admission-wait-secs": "the gate is on the HTTP PD path (SMG 1.13: gRPC only), and 0 "
    "turns it off (SMG: shed at once)",
}


def launch_row(row: Flag) -> Flag:
    """A serve row as launch takes it."""
    changes: dict[str, Any] = {}
    if row.name == "--max-concurrent-requests":
        changes.update(convert=smg_concurrency, help=row.help.replace(
            "-1: no limit", "-1: 1024 per core, at least 4096; 0: no limit"))  # fmt: skip
    if row.name == "--prometheus-host":
        changes.update(default=None)
    if row.name in REPEATABLE:
        changes.update(action="extend")
    if row.name in WIDER_CHOICES:
        changes.update(choices=WIDER_CHOICES[row.name][0])
    if row.name in FOLLOWS_1_13 and row.name not in LAUNCH_DIFFERS:
        changes.update(differs=None)  # serve's note compares with 0.3.2: not launch's
    if row.name in LAUNCH_DIFFERS:
        changes.update(differs=LAUNCH_DIFFERS[row.name])
    return attrs.evolve(row, **changes) if changes else row


# SMG 1.13 polls loads every `--load-monitor-interval` seconds and gave
# `--worker-startup-check-interval` back its name's meaning (start-up probing): launch polls at
# the first (`config/launch_compat.py` ignores the second, with the reason).
LOAD_MONITOR_INTERVAL = Flag(
    "--load-monitor-interval",
    "how often the engines' loads (/v1/loads) are polled, for the load-aware policies and "
    "overload protection",
    "load_poll_interval_secs",
    default=10,
    type=int,
)
STARTUP_CHECK = "--worker-startup-check-interval"
LAUNCH_FLAGS: tuple[Flag, ...] = (
    *(launch_row(row) for row in SERVE_FLAGS if row.name != STARTUP_CHECK),
    LOAD_MONITOR_INTERVAL,
)
