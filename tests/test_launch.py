"""`trio-pd launch` held against SMG 1.13.0's `smg launch` flag surface (and 0.3.2's).

Every flag of `smg launch` (tests/data/smg_1.13.0_flags.json, with its provenance), and every
second spelling of one, is in `trio-pd launch --help`, parses with SMG's arity, and is
implemented (serve's row, SMG 1.13's meaning where 1.13 changed it), ignored with a warning
naming it, or refused with a message naming it (exit 2):
never argparse's "unrecognized arguments". The examples of `smg launch --help` parse; the PD
ones build a RouterConfig. docs/smg-1.13.md's table is the one `tests/launch_surface.py` makes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from tests.flag_surface import sglang_flags
from tests.launch_surface import (
    AS_1_13,
    PAGE,
    launch_actions,
    page_section,
    smg_flags,
    smg_list,
    smg_table,
    treatment,
)
from tests.test_flag_surface import COMPANIONS, SAMPLES, WORKERS
from trio_pd.cli.launch import foreign_rows
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config.flags import BY_NAME
from trio_pd.config.flags.launch import (
    FOLLOWS_1_13,
    LAUNCH_DIFFERS,
    LAUNCH_FLAGS,
    WIDER_CHOICES,
    available_cores,
)
from trio_pd.config.launch_compat import UPSTREAM_HTTP2

SMG = smg_flags()
SPELLINGS = sorted(
    (alias, flag) for flag, spec in SMG.items() for alias in [flag, *spec["aliases"]]
)
SMG_SAMPLES: dict[str, list[str]] = {
    **SAMPLES,
    "--encode": ["http://127.0.0.1:30021", "9002"],
    "--cache-boundaries": ["256,1024"],
    "--tenant-api-key": ["tenant-a:secret"],
    "--model-alias": ["alias=model"],
    "--encode-selector": ["role=encode"],
    "--router-selector": ["app=router"],
    "--worker-overload-token-usage": ["0.5"],  # SMG's range (0, 1], as serve checks it
}


def sample(flag: str, spec: dict[str, Any]) -> list[str]:
    """The flag with a value SMG's parser would take."""
    if spec["switch"]:
        return [flag]
    if flag in SMG_SAMPLES:
        return [flag, *SMG_SAMPLES[flag]]
    if spec["choices"]:
        value = spec["default"] if spec["default"] in spec["choices"] else spec["choices"][0]
        return [flag, str(value)]
    if spec["type"] in ("int", "_non_negative_int"):
        return [flag, "7"]
    if spec["type"] == "float":
        return [flag, "2.5"]
    return [flag, "value"]


def parse(argv: list[str], command: str = "launch") -> Any:
    return build_parser().parse_args([command, *argv])


def config_of(argv: list[str], command: str = "launch") -> Any:
    return router_config(parse(argv, command))


def test_the_smg_list_is_the_whole_surface() -> None:
    assert "smg 1.13.0 from PyPI" in smg_list()["provenance"]
    assert len(SMG) == 212  # `smg launch --help` of smg 1.13.0, --help aside
    assert {"--prefill", "--upstream-http2", "--enable-mesh", "--max-concurrent-requests"} <= set(
        SMG
    )


def test_every_smg_flag_is_classified() -> None:
    """A flag 1.13 has and trio_pd neither implements, nor ignores, nor refuses fails here (as
    one a newer list would add); so does a note naming no SMG flag."""
    treated = {flag: treatment(flag)[0] for flag in SMG}  # Unclassified raises
    statuses = {"as in SMG", AS_1_13, "differs", "ignored", "refused"}
    assert set(treated.values()) <= statuses | {row.status for row in foreign_rows()}
    assert not set(LAUNCH_DIFFERS) - set(SMG)
    assert not set(FOLLOWS_1_13) - set(SMG)
    assert not set(WIDER_CHOICES) - set(SMG)
    launch_only = [row.flag for row in foreign_rows() if row.flag not in BY_NAME]
    stale = [f for f in launch_only if f not in SMG and f not in sglang_flags()]
    assert not stale


def test_every_spelling_of_both_lists_is_in_launch_help() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "trio_pd", "launch", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = set(re.findall(r"--[a-z0-9-]+", shown))
    missing = sorted({alias for alias, _ in SPELLINGS} - listed)
    assert not missing, f"not in `trio-pd launch --help`: {missing}"
    assert not set(sglang_flags()) - set(launch_actions()), "0.3.2's flags are launch's too"


def test_implemented_flags_keep_smg_defaults_and_choices() -> None:
    from tests.flag_surface import same_default

    actions = launch_actions()
    launch_rows = {row.name for row in LAUNCH_FLAGS}
    implemented = [flag for flag in SMG if flag in launch_rows]
    assert len(implemented) > 60
    for flag in implemented:
        spec, action = SMG[flag], actions[flag]
        # A switch not given is off whether SMG's parser says None or False.
        unset_switch = spec["switch"] and action.default is False and spec["default"] is None
        if not same_default(action.default, spec["default"]) and not unset_switch:
            assert treatment(flag)[0] == "differs", f"{flag}: default {action.default!r} not 1.13's"
        if spec["choices"]:
            missing = set(spec["choices"]) - {str(c) for c in action.choices or ()}
            assert not missing, f"{flag} does not parse SMG's {sorted(missing)}"


@pytest.mark.parametrize(("spelling", "flag"), SPELLINGS)
def test_each_smg_flag_parses_with_its_treatment(
    spelling: str, flag: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Implemented: a config. Ignored: a warning naming the flag. Refused: exit 2
    with a message naming the flag and saying why, never "unrecognized arguments"."""
    words = sample(spelling, SMG[flag]) + COMPANIONS.get(flag, [])
    argv = [a.format(tmp=tmp_path) for a in words]
    if flag not in ("--prefill", "--decode"):
        argv = WORKERS + argv
    status, why = treatment(flag)
    if status.startswith("refused"):
        with pytest.raises(SystemExit) as exited:
            config_of(argv)
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and why[:40] in err and "unrecognized" not in err
        return
    config = config_of(argv)
    warned = [w for w in config.startup_warnings if w.startswith(flag)]
    if status == "ignored":
        assert warned, f"{spelling} is ignored without a warning"
    else:
        assert not warned


def help_examples() -> list[list[str]]:
    """The command lines of `smg launch --help`'s examples, as a shell joins them (a `\\` ends
    a line that continues; what follows it on that line is a comment)."""
    commands, current = [], []
    for line in smg_list()["help_examples"].splitlines():
        line = line.strip()
        if not line or line.startswith("#") or line == "Examples:":
            continue
        current += line.split("\\")[0].split()
        if "\\" not in line:
            commands.append(current[3:])  # after `python -m smg.launch_router`
            current = []
    return commands


def test_the_help_examples_parse() -> None:
    """SMG's five: regular mode and EPD are refused with their reason; the three PD lines
    build the config they ask for."""
    examples = help_examples()
    assert len(examples) == 5 and all(e[0].startswith("--") for e in examples)
    regular, same_policy, ports, two_policies, epd = examples
    for refused, reason in ((regular, "--worker-urls"), (epd, "--epd-disaggregation")):
        with pytest.raises(SystemExit) as exited:
            config_of(refused)
        assert exited.value.code == 2, reason
    config = config_of(same_policy)
    assert [w.bootstrap_port for w in config.prefill] == [9000, None]
    assert len(config.decode) == 2 and config.policy.policy == "cache_aware"
    config = config_of(ports)
    assert [w.bootstrap_port for w in config.prefill] == [9000, None, None]
    config = config_of(two_policies)
    assert (config.policy.prefill_policy, config.policy.decode_policy) == (
        "cache_aware",
        "power_of_two",
    )


def test_refused_examples_say_why(capsys: pytest.CaptureFixture[str]) -> None:
    regular, *_, epd = help_examples()
    for argv, reason in ((regular, "routes prefill/decode pairs only"), (epd, "EPD")):
        with pytest.raises(SystemExit):
            config_of(argv)
        err = capsys.readouterr().err
        assert reason in err and "unrecognized" not in err


def test_max_concurrent_requests_is_each_version_s() -> None:
    """-1: no cap under serve (0.3.2); 1024 per core, at least 4096, under launch (1.13)."""
    assert config_of(WORKERS, "serve").max_concurrent_requests == -1
    derived = config_of(WORKERS).max_concurrent_requests
    assert derived == max(1024 * available_cores(), 4096) and derived >= 4096
    assert config_of([*WORKERS, "--max-concurrent-requests", "-1"]).max_concurrent_requests == (
        derived
    )
    assert config_of([*WORKERS, "--max-concurrent-requests", "0"]).max_concurrent_requests == -1
    assert config_of([*WORKERS, "--max-concurrent-requests", "64"]).max_concurrent_requests == 64
    assert (
        config_of([*WORKERS, "--max-concurrent-requests", "0"], "serve").max_concurrent_requests
        == 0
    )


def test_loads_are_polled_at_each_version_s_interval() -> None:
    """1.13 polls loads every --load-monitor-interval (10 s) and gave
    --worker-startup-check-interval back to start-up probing; 0.3.2 polled at the latter (30)."""
    assert config_of(WORKERS, "serve").load_poll_interval_secs == 30
    assert config_of(WORKERS).load_poll_interval_secs == 10
    assert config_of([*WORKERS, "--load-monitor-interval", "3"]).load_poll_interval_secs == 3
    ignored = config_of([*WORKERS, "--worker-startup-check-interval", "7"])
    assert ignored.load_poll_interval_secs == 10
    assert any(w.startswith("--worker-startup-check-interval") for w in ignored.startup_warnings)


def test_prometheus_host_follows_host_under_launch() -> None:
    assert config_of([*WORKERS, "--host", "::1"], "serve").prometheus_host == "0.0.0.0"
    assert config_of([*WORKERS, "--host", "::1"]).prometheus_host == "::"
    assert config_of([*WORKERS, "--host", "127.0.0.1"]).prometheus_host == "0.0.0.0"
    given = [*WORKERS, "--host", "::1", "--prometheus-host", "127.0.0.1"]
    assert config_of(given).prometheus_host == "127.0.0.1"


def test_cors_origins_are_each_version_s() -> None:
    serve = config_of(WORKERS, "serve")
    assert serve.cors_enabled and serve.cors_allowed_origins == ()  # any origin
    launch = config_of(WORKERS)
    assert not launch.cors_enabled  # no cross-origin allowance
    star = config_of([*WORKERS, "--cors-allowed-origins", "*"])
    assert star.cors_enabled and star.cors_allowed_origins == ()
    with pytest.raises(SystemExit):
        config_of([*WORKERS, "--cors-allowed-origins", "*"], "serve")


def test_list_flags_add_up_under_launch() -> None:
    argv = ["--request-id-headers", "x-a", "--request-id-headers", "x-b"]
    assert config_of([*WORKERS, *argv]).request_id_headers == ("x-a", "x-b")
    assert config_of([*WORKERS, *argv], "serve").request_id_headers == ("x-b",)


def test_second_spellings_land_on_the_row() -> None:
    config = config_of([*WORKERS, "--spill-abs-threshold", "3", "--cache-match-threshold", "0.7"])
    assert config.policy.balance_abs_threshold == 3 and config.policy.cache_threshold == 0.7


def test_a_wider_choice_is_refused_with_its_reason(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        config_of([*WORKERS, "--policy", "passthrough"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--policy passthrough: is not a policy of trio_pd" in err


def run_launch(*argv: str) -> subprocess.CompletedProcess[str]:
    """`python -m trio_pd launch ...` for a line refused before anything is served (the one
    that serves is tests/ops/test_launch_lines.py's)."""
    return subprocess.run(
        [sys.executable, "-m", "trio_pd", "launch", *WORKERS, *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_upstream_http2_exits_2_with_its_reason() -> None:
    done = run_launch("--upstream-http2")
    assert done.returncode == 2
    assert f"--upstream-http2: {UPSTREAM_HTTP2}" in " ".join(done.stderr.split())
    assert "unrecognized" not in done.stderr


def test_the_table_is_current() -> None:
    expected = smg_table()
    assert expected.count("\n") == len(SMG) + 1
    assert page_section(PAGE.read_text()) == expected, (
        "docs/smg-1.13.md flag table out of date: run `python -m tests.launch_surface`"
    )
