"""The request-id and CORS flags on a real `trio-pd serve --workers 2`: from the command line
through each process's share of the config to the answers on the socket."""

from __future__ import annotations

from pathlib import Path

import httpx2
import trio

from tests.conftest import start_engine
from tests.ops.serve import start_serve
from tests.router.helpers import generate_body

ORIGIN = "https://app.example"


async def test_request_id_and_cors_flags_reach_every_process(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"),
        "--workers", "2", "--request-id-headers", "x-my-id",
        "--cors-allowed-origins", ORIGIN, "http://localhost:3000",
    )  # fmt: skip
    try:
        await router.wait_ready()
        async with httpx2.AsyncClient(base_url=router.url, timeout=30) as client:
            for n in range(6):  # new connections: SO_REUSEPORT spreads them over both processes
                rid = f"mine-{n}"
                headers = {"x-my-id": rid, "x-request-id": "not-listed", "origin": ORIGIN}
                response = await client.post(
                    "/generate", json=generate_body(), headers={**headers, "connection": "close"}
                )
                assert response.status_code == 200, response.text
                assert response.headers["x-request-id"] == rid
                assert response.headers["access-control-allow-origin"] == ORIGIN
                assert decode.events.find("request_start", rid=rid)
                preflight = await client.options(
                    "/generate",
                    headers={"origin": ORIGIN, "access-control-request-method": "POST",
                             "connection": "close"},
                )  # fmt: skip
                assert preflight.status_code == 200
                assert preflight.headers["access-control-allow-methods"] == "GET,POST,OPTIONS"
            other = await client.get("/health", headers={"origin": "https://evil.example"})
            assert "access-control-allow-origin" not in other.headers
        assert not decode.events.find("request_start", rid="not-listed")
    finally:
        await router.stop()
