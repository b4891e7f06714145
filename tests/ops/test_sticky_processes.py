"""`trio-pd serve --workers 2 --policy manual`: each process keeps its own routing-key table, yet
a key lands on the same pair whichever process takes its connection (rendezvous placement)."""

from __future__ import annotations

from pathlib import Path

import httpx2
import trio

from tests.conftest import start_engine
from tests.ops.serve import PROCESSES_SECS, start_serve
from tests.router.fleet_tools import who_started
from tests.router.helpers import generate_body

LOOSE = 10.0


async def test_a_key_lands_on_one_pair_through_either_process(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefills = [await start_engine(nursery, "prefill") for _ in range(3)]
    decodes = [await start_engine(nursery, "decode") for _ in range(3)]
    router = await start_serve(
        prefills, decodes, str(tmp_path / "router.log"), "--workers", "2", "--policy", "manual"
    )
    clients: dict[int, httpx2.AsyncClient] = {}
    try:
        await router.wait_ready()
        with trio.fail_after(PROCESSES_SECS):  # one keep-alive client per process, each ready
            while len(clients) < 2:
                client = httpx2.AsyncClient(base_url=router.url, timeout=LOOSE)
                pid = (await client.get("/liveness")).json()["pid"]
                if pid in clients:
                    await client.aclose()
                    continue
                while (await client.get("/readiness")).status_code != 200:
                    await trio.sleep(0.1)
                clients[pid] = client
        pairs: dict[str, set[tuple[int, int]]] = {}
        for round_ in range(2):
            for pid, client in clients.items():
                for k in range(8):
                    rid = f"k{k}-{pid}-{round_}"
                    response = await client.post(
                        "/generate",
                        json=generate_body(),
                        headers={"x-request-id": rid, "x-smg-routing-key": f"session-{k}"},
                    )
                    assert response.status_code == 200, response.text
                    [p] = who_started(prefills, rid)
                    [d] = who_started(decodes, rid)
                    pairs.setdefault(f"session-{k}", set()).add((p, d))
        assert all(len(seen) == 1 for seen in pairs.values()), pairs
        assert len({pair for [pair] in pairs.values()}) >= 2  # and the keys spread
    finally:
        for client in clients.values():
            await client.aclose()
        await router.stop()
