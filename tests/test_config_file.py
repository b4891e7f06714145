"""`trio-pd serve --config FILE`: the same settings as flags, from a TOML file (hypercorn's
format for its own config), the command line winning, every key checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_pd.cli.main import build_parser, router_config

TOML = """
prefill = ["http://10.0.0.1:30000 8998", ["http://10.0.0.2:30000", "none"]]
decode = "http://10.0.0.3:30000"
policy = "round_robin"
queue-size = 7
retry_max_retries = 2
disable-circuit-breaker = true
cors-allowed-origins = ["https://app.example"]
service-discovery = false
"""


def parse(*argv: str):
    return router_config(build_parser().parse_args(["serve", *argv]))


def test_a_config_file_gives_every_kind_of_flag(tmp_path: Path) -> None:
    path = tmp_path / "router.toml"
    path.write_text(TOML)
    config = parse("--config", str(path))
    assert [(w.url, w.bootstrap_port) for w in config.prefill] == [
        ("http://10.0.0.1:30000", 8998), ("http://10.0.0.2:30000", None),
    ]  # fmt: skip
    assert [w.url for w in config.decode] == ["http://10.0.0.3:30000"]
    assert config.policy.policy == "round_robin" and config.queue_size == 7
    assert config.retry.max_retries == 2 and config.breaker.enabled is False
    assert config.cors_allowed_origins == ("https://app.example",)
    assert config.kubernetes is None
    # The command line wins over the file; its workers come after the file's.
    config = parse("--config", str(path), "--queue-size", "9", "--decode", "http://10.0.0.4:1")
    assert config.queue_size == 9
    assert [w.url for w in config.decode] == ["http://10.0.0.3:30000", "http://10.0.0.4:1"]


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("queue-sise = 7", "no flag --queue-sise"),
        ("queue-size = [", "not TOML"),
        ('queue-size = "many"', "invalid int value"),
        ("max-buffered-bytes = -1", "--max-buffered-bytes must be 0"),
    ],
)
def test_a_bad_config_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, words: str
) -> None:
    path = tmp_path / "router.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_:
        parse("--config", str(path), "--prefill", "http://a:1", "--decode", "http://b:2")
    assert exit_.value.code == 2
    assert words in capsys.readouterr().err


def test_a_missing_config_file_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--config", "/nonexistent/router.toml")
    assert "--config /nonexistent/router.toml" in capsys.readouterr().err
