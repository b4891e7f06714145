"""`trio-pd launch --cors-allowed-origins`: a `*` anywhere in the list means any origin, as in
SMG 1.13 (issue 28's survivor: only a list of `*` alone was tested). The config is the one a
launch command line gives, served by a real router in front of simulator engines."""

from __future__ import annotations

import attrs
import httpx2
import pytest
import trio

from tests.conftest import ROUTER_DEFAULTS, start_engine, start_router, wait_until_ready
from tests.router.helpers import generate_body
from trio_pd.cli.main import build_parser, router_config

OTHER = "https://other.example"
LISTED = "https://app.example"


@pytest.mark.parametrize(
    "origins", [[LISTED, "*"], ["*", LISTED], [LISTED, "*", "https://b.example"]]
)
async def test_a_star_anywhere_in_the_launch_list_allows_any_origin(
    nursery: trio.Nursery, origins: list[str]
) -> None:
    """Break: only a list whose first (or only) entry is `*` counts as any origin: the others
    would allow the named origins alone, and `*` would be taken for an origin's name."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    argv = [
        "launch",
        "--pd-disaggregation",
        "--prefill", prefill.url, str(prefill.bootstrap_port),
        "--decode", decode.url,
        "--cors-allowed-origins", *origins,
    ]  # fmt: skip
    config = router_config(build_parser().parse_args(argv))
    config = attrs.evolve(config, **ROUTER_DEFAULTS)  # loopback, ephemeral ports
    _, url = await start_router(nursery, config)
    async with httpx2.AsyncClient(base_url=url, timeout=httpx2.Timeout(20.0)) as client:
        await wait_until_ready(client)
        for origin in (OTHER, LISTED):
            response = await client.post(
                "/generate", json=generate_body(), headers={"origin": origin}
            )
            assert response.status_code == 200, response.text
            assert response.headers.get("access-control-allow-origin") == "*", origin
        # What the engines saw: the request went through (CORS never gates the data plane).
        assert len(decode.events.find("request_start")) == 2
