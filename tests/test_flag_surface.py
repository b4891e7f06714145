"""The whole flag surface of SGLang's router (sglang-router 0.3.2) held against `trio-pd serve`.

Every flag of `python -m sglang_router.launch_router` (tests/data, with its provenance) is in
`trio-pd serve --help`, parses with SGLang's arity, and is either implemented with SGLang's
default, ignored with a warning naming it, or refused with a message naming it: never argparse's
"unrecognized arguments". docs/flags.md's tables are the ones `tests/flag_surface.py` makes.
"""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

import pytest

from tests.flag_surface import (
    FLAGS_PAGE,
    TABLES,
    page_section,
    same_default,
    serve_actions,
    serve_parser,
    sglang_flags,
)
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import compat
from trio_pd.config.flags import DIFFERS

SGLANG = sglang_flags()

# A value of the right shape for flags whose value is checked (URLs, key=value, key entries).
SAMPLES: dict[str, list[str]] = {
    "--discovery-provider": ["file"],  # (with its manifest: COMPANIONS)
    "--prefill": ["http://127.0.0.1:30001", "9001"],
    "--decode": ["http://127.0.0.1:30011"],
    "--worker-urls": ["http://127.0.0.1:8000"],
    "--selector": ["app=sglang"],
    "--prefill-selector": ["role=prefill"],
    "--decode-selector": ["role=decode"],
    "--control-plane-api-keys": ["k1:ops:admin:secret"],
    "--prometheus-duration-buckets": ["0.1", "1", "10"],
    "--request-id-headers": ["x-request-id", "x-trace-id"],
    "--cors-allowed-origins": ["http://localhost:3000"],
    "--otlp-traces-endpoint": ["127.0.0.1:4317"],
    "--ca-cert-paths": [],
    "--jwt-role-mapping": ["Gateway.Admin=admin"],
    "--host": ["127.0.0.1"],
    "--health-check-endpoint": ["/health"],
    "--log-dir": ["{tmp}"],
}
# Flags that only make sense with another (SGLang requires the same pairs).
COMPANIONS: dict[str, list[str]] = {
    "--service-discovery": [
        "--prefill-selector",
        "role=prefill",
        "--decode-selector",
        "role=decode",
        "--kube-api-server",
        "http://127.0.0.1:1",
    ],
    "--tls-cert-path": ["--tls-key-path", "{tmp}/key.pem"],
    "--tls-key-path": ["--tls-cert-path", "{tmp}/cert.pem"],
    "--client-cert-path": ["--client-key-path", "{tmp}/key.pem"],
    "--client-key-path": ["--client-cert-path", "{tmp}/cert.pem"],
    # SMG 1.13's file discovery: its flags need the provider, the provider its manifest.
    "--discovery-provider": ["--discovery-file", "{tmp}/workers.json"],
    "--discovery-file": ["--discovery-provider", "file"],
    "--discovery-check-interval-secs": [
        "--discovery-provider",
        "file",
        "--discovery-file",
        "{tmp}/workers.json",
    ],
}
WORKERS = ["--prefill", "http://127.0.0.1:30001", "--decode", "http://127.0.0.1:30011"]


def sample(flag: str, spec: dict[str, Any]) -> list[str]:
    """The flag with a value SGLang's parser would take."""
    if spec["switch"]:
        return [flag]
    if flag in SAMPLES:
        return [flag, *SAMPLES[flag]]
    if spec["choices"]:
        value = spec["default"] if spec["default"] in spec["choices"] else spec["choices"][-1]
        return [flag, str(value)]
    if spec["type"] == "int":
        return [flag, "7"]
    if spec["type"] == "float":
        return [flag, "2.5"]
    return [flag, "value"]


def parse(argv: list[str]) -> Any:
    return build_parser().parse_args(["serve", *argv])


def test_the_sglang_list_is_the_whole_surface() -> None:
    assert len(SGLANG) >= 95  # sglang-router 0.3.2 has 98 flags besides --help
    assert {"--prefill", "--decode", "--policy", "--enable-trace", "--jwt-issuer"} <= set(SGLANG)


def test_every_sglang_flag_is_in_serve_help() -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "trio_pd", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    listed = set(re.findall(r"(?m)^\s+(--[a-z0-9-]+)", shown))
    missing = sorted(set(SGLANG) - listed)
    assert not missing, f"not in `trio-pd serve --help`: {missing}"


def test_help_shows_every_default() -> None:
    text = serve_parser().format_help()
    text = text[text.index("options:") :]  # past the usage lines
    for flag, action in serve_actions().items():
        if action.default is None or action.nargs == 0:
            continue
        block = text[text.index(f"\n  {flag}") + 1 :].split("\n  -", 1)[0]
        assert "default:" in block, f"{flag}: --help shows no default"


def test_foreign_flags_are_sglang_flags() -> None:
    assert compat.FOREIGN, "compat lists SGLang's flags trio_pd does not implement"
    stale = [f.flag for f in compat.FOREIGN if f.flag not in SGLANG]
    assert not stale
    stale_notes = [flag for flag in DIFFERS if flag not in SGLANG]
    assert not stale_notes


def test_implemented_flags_keep_sglang_defaults_and_choices() -> None:
    actions = serve_actions()
    implemented = [flag for flag in SGLANG if flag not in compat.BY_FLAG]
    assert len(implemented) > 50
    for flag in implemented:
        spec, action = SGLANG[flag], actions[flag]
        if not same_default(action.default, spec["default"]):
            assert flag in DIFFERS, f"{flag}: default {action.default!r} is not SGLang's"
        if spec["choices"]:
            assert action.choices is not None, flag
            missing = set(spec["choices"]) - set(action.choices)
            assert not missing, f"{flag} refuses SGLang's {sorted(missing)}"


@pytest.mark.parametrize("flag", sorted(SGLANG))
def test_each_sglang_flag_parses_with_its_meaning(
    flag: str, tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Implemented: parses into a config. Ignored: a warning naming the flag. Refused: exit 2
    with a message naming the flag and saying why, never "unrecognized arguments"."""
    argv = [a.format(tmp=tmp_path) for a in sample(flag, SGLANG[flag]) + COMPANIONS.get(flag, [])]
    if flag not in ("--prefill", "--decode"):
        argv = WORKERS + argv
    foreign = compat.BY_FLAG.get(flag)
    if foreign is not None and foreign.refuse(getattr(parse(argv), foreign.dest)):
        with pytest.raises(SystemExit) as exited:
            router_config(parse(argv))
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert flag in err and foreign.why[:40] in err and "unrecognized" not in err
        return
    config = router_config(parse(argv))
    warned = [w for w in config.startup_warnings if w.startswith(flag)]
    if foreign is not None and not foreign.matches(getattr(parse(argv), foreign.dest)):
        assert warned, f"{flag} is ignored without a warning"
    elif flag != "--mini-lb":
        assert not warned


def test_a_refused_value_of_an_accepted_flag() -> None:
    assert router_config(parse([*WORKERS, "--backend", "sglang"])).startup_warnings == ()
    with pytest.raises(SystemExit):
        router_config(parse([*WORKERS, "--backend", "openai"]))
    assert router_config(parse([*WORKERS, "--worker-urls"])).startup_warnings == ()


def test_mini_lb_routes_at_random() -> None:
    config = router_config(parse([*WORKERS, "--mini-lb", "--policy", "cache_aware"]))
    assert config.policy.policy == "random"
    assert config.policy.prefill_policy is None and config.policy.decode_policy is None
    assert any("--mini-lb" in w for w in config.startup_warnings)


@pytest.mark.parametrize("which", sorted(TABLES))
def test_the_flag_tables_are_current(which: str) -> None:
    expected = TABLES[which]()
    assert expected.count("\n") > 10
    assert page_section(FLAGS_PAGE.read_text(), which) == expected, (
        "docs/flags.md flag table out of date: run `python -m tests.flag_surface`"
    )
