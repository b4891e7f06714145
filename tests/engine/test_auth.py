"""--api-key: Bearer auth on every route but /health* and /metrics*; the bootstrap is open."""

from __future__ import annotations

import httpx2

from .helpers import new_room, pd_body, pd_post, start_engine

KEY = "sekrit"
AUTH = {"authorization": f"Bearer {KEY}"}


async def test_api_key_guards_every_route_but_health_and_metrics(nursery, client):
    prefill = await start_engine(nursery, "prefill", api_key=KEY)
    decode = await start_engine(nursery, "decode", api_key=KEY)
    for engine in (prefill, decode):
        assert (await client.get(engine.url + "/health")).status_code == 200
        assert (await client.get(engine.url + "/health_generate")).status_code == 200
        assert (await client.get(engine.url + "/metrics")).status_code == 404  # open, absent
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            r = await client.get(engine.url + "/model_info", headers=headers)
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        r = await client.get(engine.url + "/get_model_info", headers=AUTH)
        assert r.status_code == 200
    r = await client.post(
        decode.url + "/generate",
        json=pd_body(prefill, new_room(), text="a"),
        headers={"x-request-id": "no-key"},
    )
    assert r.status_code == 401
    refused = decode.events.find("unauthorized", rid="no-key")[0]
    assert refused["path"] == "/generate" and refused["method"] == "POST"
    assert not decode.events.find("request_start")  # refused before the engine saw it
    r = await client.post(decode.url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 401 and not decode.events.find("abort_request")
    # with the key, a PD request works: decode's registration needs no key (bootstrap is open)
    async with httpx2.AsyncClient(trust_env=False, timeout=20, headers=AUTH) as authed:
        room = new_room()
        p, d = await pd_post(authed, prefill, decode, "/generate", pd_body(prefill, room, text="a"))
        assert p.status_code == d.status_code == 200
        bootstrap = f"http://127.0.0.1:{prefill.bootstrap_port}/health"
        assert (await client.get(bootstrap)).status_code == 200
    assert decode.events.find("kv_ready", room=room)


async def test_no_api_key_means_open(pair, client):
    prefill, _ = pair
    assert (await client.get(prefill.url + "/get_model_info")).status_code == 200
    assert not prefill.events.find("unauthorized")


async def test_abort_request_is_admin_optional(nursery, client):
    """utils/auth.py ADMIN_OPTIONAL: open without keys; with only --api-key it needs that key;
    with --admin-api-key it needs THAT key and refuses the ordinary one (NORMAL routes keep
    needing the api key, and the admin key does not open them)."""
    admin = {"authorization": "Bearer boss"}
    both = await start_engine(nursery, "decode", api_key=KEY, admin_api_key="boss")
    r = await client.post(both.url + "/abort_request", json={"abort_all": True}, headers=AUTH)
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    r = await client.post(both.url + "/abort_request", json={"abort_all": True}, headers=admin)
    assert r.status_code == 200
    assert (await client.get(both.url + "/model_info", headers=admin)).status_code == 401
    assert (await client.get(both.url + "/model_info", headers=AUTH)).status_code == 200
    lower = {"authorization": f"bearer {KEY}"}  # the scheme is case-insensitive
    assert (await client.get(both.url + "/model_info", headers=lower)).status_code == 200
    admin_only = await start_engine(nursery, "decode", admin_api_key="boss")
    assert (await client.get(admin_only.url + "/model_info")).status_code == 200  # open
    r = await client.post(admin_only.url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 401
    r = await client.post(
        admin_only.url + "/abort_request", json={"abort_all": True}, headers=admin
    )
    assert r.status_code == 200
    key_only = await start_engine(nursery, "decode", api_key=KEY)
    r = await client.post(key_only.url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 401
    r = await client.post(key_only.url + "/abort_request", json={"abort_all": True}, headers=AUTH)
    assert r.status_code == 200
    assert (await client.get(key_only.url + "/ready")).status_code == 200  # probes stay open
    open_engine = await start_engine(nursery, "decode")
    r = await client.post(open_engine.url + "/abort_request", json={"abort_all": True})
    assert r.status_code == 200
    refused = [e["path"] for e in both.events.find("unauthorized")]
    assert refused == ["/abort_request", "/model_info"]
