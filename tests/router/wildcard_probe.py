"""Run inside a network namespace of its own (`tests/router/test_wildcard_router.py` starts it
under `unshare -rn`, with 10.11.12.13 added to that namespace's loopback): a real router with
its listeners bound to the wildcard address, simulator engines, and a worker URL naming the
host's own non-loopback address on the router's metrics port, which no check before the
connect can know is the router (`Destinations.check_connected`). Prints what happened as JSON.
"""

from __future__ import annotations

import json
import sys

import httpx2
import trio

from tests.conftest import ROUTER_DEFAULTS, start_engine, start_router, wait_until_ready
from trio_pd.config import RouterConfig
from trio_pd.fleet import health
from trio_pd.spec import WorkerSpec
from trio_pd_testing.ports import free_port

HOST_ADDRESS = "10.11.12.13"  # this namespace's own address, not a loopback one


def refused(router, client: str) -> float:
    labels = {"client": client, "reason": "router_itself"}
    value = router.metrics.registry.get_sample_value(
        "trio_pd_upstream_connects_refused_total", labels
    )
    return value or 0.0


async def probe() -> dict[str, object]:
    out: dict[str, object] = {}
    async with trio.open_nursery() as nursery:
        prefill = await start_engine(nursery, "prefill")
        decode = await start_engine(nursery, "decode")
        metrics_port = free_port()
        config = RouterConfig(
            prefill=(WorkerSpec(prefill.url, "prefill", prefill.bootstrap_port),),
            decode=(WorkerSpec(decode.url, "decode"),),
            **{**ROUTER_DEFAULTS, "host": "0.0.0.0"},
            prometheus_host="0.0.0.0",
            prometheus_port=metrics_port,
        )
        router, url = await start_router(nursery, config)
        local = f"http://127.0.0.1:{url.rsplit(':', 1)[1]}"
        admin_url = router.access.admin_url
        async with (
            httpx2.AsyncClient(base_url=local, timeout=20) as client,
            httpx2.AsyncClient(base_url=admin_url, timeout=20) as admin,
        ):
            await wait_until_ready(client)
            target = f"http://{HOST_ADDRESS}:{metrics_port}"
            added = await admin.post("/workers", json={"url": target, "worker_type": "decode"})
            out["added"] = added.status_code
            worker = router.fleet.get(added.json()["id"])
            # The control plane: its probes connect, then find the router (or would be served
            # by its metrics listener, a 404, without the check).
            with trio.move_on_after(10):
                while refused(router, "control") < 1:
                    await trio.sleep(0.05)
            out["control_refused"] = refused(router, "control")
            # The legs: the worker as the only decode. Its probes are made to pass from here
            # (else no leg would be sent to it); the leg's own connect finds the router.
            removed = await admin.delete("/workers/decode-1")
            out["removed"] = removed.status_code

            async def passes(*args: object) -> None:
                return None

            health.probe_once = passes  # type: ignore[assignment]
            with trio.move_on_after(10):
                while not worker.healthy:
                    await trio.sleep(0.05)
            out["healthy"] = worker.healthy
            response = await client.post(
                "/generate", json={"text": "a b", "sampling_params": {"max_new_tokens": 2}}
            )
            out["leg_status"] = response.status_code
            out["leg_message"] = response.json().get("error", {}).get("message", "")
            out["legs_refused"] = refused(router, "legs")
            out["decode_saw"] = len(decode.events.find("request_start"))
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    json.dump(trio.run(probe), sys.stdout)


if __name__ == "__main__":
    main()
