"""Why routers must cancel decode: a naive JOIN proxy holds the decode slot for the whole
waiting timeout when prefill fails (the SMG 0.3.2 behaviour the simulator must reproduce)."""

from __future__ import annotations

import random
from functools import partial

import httpx2
import hypercorn.config
import hypercorn.trio
import orjson
import trio

from .helpers import start_engine


class JoinProxy:
    """Send to prefill and decode concurrently, wait for BOTH, answer with decode's response."""

    def __init__(self, client, prefill, decode):
        self.client, self.prefill, self.decode = client, prefill, decode

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while (message := await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        raw, more = b"", True
        while more:
            message = await receive()
            raw += message.get("body", b"")
            more = message.get("more_body", False)
        body = orjson.loads(raw)
        body.update(
            bootstrap_host="127.0.0.1",
            bootstrap_port=self.prefill.bootstrap_port,
            bootstrap_room=random.randrange(1, 2**63),
        )
        results = {}

        async def leg(name, engine):
            results[name] = await self.client.post(engine.url + scope["path"], json=body)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(leg, "prefill", self.prefill)
            nursery.start_soon(leg, "decode", self.decode)
        answer = results["decode"]
        headers = [(b"content-type", answer.headers["content-type"].encode())]
        await send(
            {"type": "http.response.start", "status": answer.status_code, "headers": headers}
        )
        await send({"type": "http.response.body", "body": answer.content})


async def test_join_proxy_holds_decode_slot_until_waiting_timeout(nursery, client):
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", waiting_timeout=2.0)
    async with httpx2.AsyncClient(trust_env=False, timeout=30) as upstream:
        config = hypercorn.config.Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        binds = await nursery.start(
            partial(hypercorn.trio.serve, JoinProxy(upstream, prefill, decode), config)
        )
        start = trio.current_time()
        r = await client.post(
            binds[0] + "/generate", json={"text": "a b", "sim_fault": "prefill:500"}
        )
        waited = trio.current_time() - start
    assert r.status_code == 500  # decode's timeout error, not prefill's failure
    assert "timed out" in r.json()["message"] and r.json()["object"] == "error"
    fault = prefill.events.find("fault")[0]
    freed = await decode.events.wait_for("slot_freed")
    assert freed["reason"] == "kv_wait_timeout"
    assert freed["room"] == fault["room"]
    assert freed["t"] - fault["t"] > 1.5  # the slot was held ~ the whole waiting timeout
    assert waited > 1.8  # and the proxy's client waited that long for an error
