"""A membership file (`--membership-file`, or the one `--workers N` shares) edited by hand, or
broken, behind a real router (issue 19, item 14): each entry is checked as `POST /workers`
checks its body, a bad one is skipped with a warning naming it, and a file that cannot be
parsed makes changes answer 503 with an error log line (not 409, not 500)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.conftest import cluster_of, start_engine
from tests.router.fleet_tools import FAST_HEALTH, LOOSE
from tests.router.helpers import generate_body, settle
from trio_pd_testing.engine import EngineHandle


def entry(worker_id: str, engine: EngineHandle, role: str, **extra: Any) -> dict[str, Any]:
    port = engine.bootstrap_port if role == "prefill" else None
    return {"id": worker_id, "url": engine.url, "worker_type": role, "bootstrap_port": port,
            **extra}  # fmt: skip


def write(path: Path, workers: list[Any]) -> None:
    path.write_text(json.dumps({"version": 1, "serial": {}, "workers": workers}))


async def test_hand_edited_entries_are_checked_as_the_admin_api_checks_them(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_pd.membership.file")
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    bad_key = await start_engine(nursery, "decode")
    path = tmp_path / "membership.json"
    no_scheme = bad_key.url.removeprefix("http://")
    write(path, [
        entry("p", prefill, "prefill"),
        entry("d", decode, "decode"),
        {"id": "no-scheme", "url": no_scheme, "worker_type": "decode"},
        {**entry("crlf-key", bad_key, "decode"), "api_key": "k\r\nx-injected: 1"},
        {"id": "big-port", "url": "http://127.0.0.1:99999", "worker_type": "decode"},
        {**entry("port-on-decode", bad_key, "decode"), "bootstrap_port": 8998},
        "not an object",
    ])  # fmt: skip
    cluster = await cluster_of(nursery, [], [], membership_file=str(path), health=FAST_HEALTH)
    assert [w.id for w in cluster.router.fleet.workers()] == ["p", "d"]
    for _ in range(3):  # routed to the good entries, and only to them
        assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    await trio.sleep(0.5)
    assert not bad_key.events.find("info_request")  # never even probed
    warnings = [r.getMessage() for r in caplog.records if r.name == "trio_pd.membership.file"]
    for worker_id, why in [
        ("no-scheme", "http:// or https://"), ("crlf-key", "api_key must be visible ASCII"),
        ("big-port", "not a valid URL"), ("port-on-decode", "prefill workers only"),
    ]:  # fmt: skip
        assert any(f"(id {worker_id!r}) skipped: " in w and why in w for w in warnings), worker_id
    assert any("entry 7 skipped" in w for w in warnings)
    assert not any("x-injected" in w for w in warnings)  # a key is never logged
    seen = len(warnings)
    await trio.sleep(0.6)  # polls re-read nothing: the same bad entries are not logged again
    assert len([r for r in caplog.records if r.name == "trio_pd.membership.file"]) == seen
    # The admin API adds beside them, and keeps the operator's bad lines in the file.
    other = await start_engine(nursery, "decode")
    added = await cluster.admin.post("/workers", json={"url": other.url, "worker_type": "decode"})
    assert added.status_code == 202, added.text
    lines = json.loads(path.read_text())["workers"]
    assert len(lines) == 8 and "not an object" in lines
    await cluster.client.aclose()
    await cluster.admin.aclose()


async def test_a_corrupt_file_refuses_changes_with_503_and_says_why(
    nursery: trio.Nursery, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="trio_pd.membership.file")
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    extra = await start_engine(nursery, "decode")
    path = tmp_path / "membership.json"
    write(path, [entry("p", prefill, "prefill"), entry("d", decode, "decode")])
    cluster = await cluster_of(nursery, [], [], membership_file=str(path), health=FAST_HEALTH)
    path.write_text('{"version": 1, "workers": [{"id": "p", ')  # a truncated hand edit
    await settle(lambda: not cluster.router.fleet.sources.get("file", (True,))[0], LOOSE)
    assert [w.id for w in cluster.router.fleet.workers()] == ["p", "d"]  # the last good view
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    body = {"url": extra.url, "worker_type": "decode"}
    for response in (
        await cluster.admin.post("/workers", json=body),  # was a 409 "conflict"
        await cluster.admin.delete("/workers/d"),  # was a 500
    ):
        assert response.status_code == 503, response.text
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and "cannot be parsed" in error["message"]
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("changes are refused until it is fixed" in e for e in errors)
    assert not [r for r in caplog.records if r.getMessage() == "internal error"]
    await cluster.client.aclose()
    await cluster.admin.aclose()
