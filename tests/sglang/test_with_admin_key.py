"""Engines started with --api-key and --admin-api-key (a second pair, started on first use)."""

from __future__ import annotations

import pytest

from tests.sglang import scenarios


@pytest.fixture
async def client():
    async with scenarios.client() as c:
        yield c


async def test_abort_request_needs_the_admin_key(admin_target, client):
    """utils/auth.py ADMIN_OPTIONAL: with --admin-api-key, /abort_request takes only the admin
    key; the generation key and no key are 401 and abort nothing."""
    got = await scenarios.admin_key_abort(admin_target, client)
    assert got["generation_key_status"] == 401
    assert got["no_key_status"] == 401
    assert got["still_waiting_after_refused_aborts"]
    assert got["admin_key_status"] == 200
