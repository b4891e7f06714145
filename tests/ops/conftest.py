"""Fixtures of the operations tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.ops.serve import taking_turns_for

DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's --disaggregation-bootstrap-port default


@pytest.fixture
def default_bootstrap_port() -> Iterator[int]:
    """SGLang's default bootstrap port, this test's alone until it ends (`taking_turns_for`)."""
    with taking_turns_for(DEFAULT_BOOTSTRAP_PORT) as port:
        yield port
