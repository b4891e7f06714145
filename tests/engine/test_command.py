"""`trio-pd-testing`: the test engines' one command hands each subcommand whole to its own parser
(the router's `trio-pd` has none of them: tests/test_cli.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trio_pd_testing.cli import main


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("engine", "usage: trio-pd-testing engine "),
        ("sglang", "usage: python -m trio_pd_testing.sglang "),
        ("vllm", "usage: python -m trio_pd_testing.vllm "),
    ],
)
def test_each_command_is_its_own_parser(
    command: str, usage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(usage)


@pytest.mark.parametrize("argv", [[], ["serve"], ["demo", "--now"]])
def test_anything_else_is_a_usage_error(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.startswith("usage: trio-pd-testing {engine,demo,sglang,vllm}")


def test_the_launchers_find_the_checkout() -> None:
    """The real-engine launchers resolve `.venv-sglang`, `.venv-vllm` and `.cache/` from the
    checkout they sit in (testing/trio_pd_testing/<tier>/), wherever the tests run from."""
    from trio_pd_testing.sglang import launcher as sglang
    from trio_pd_testing.vllm import launcher as vllm

    checkout = Path(__file__).resolve().parents[2]
    assert (checkout / "testing" / "pyproject.toml").is_file()
    assert sglang.REPO_ROOT == vllm.REPO_ROOT == checkout
