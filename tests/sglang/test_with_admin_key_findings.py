"""Finding 5 through the router: with `--worker-admin-api-key` the router's `/abort_request`
carries the engine's admin key (an engine with `--admin-api-key` refuses its API key there)."""

from __future__ import annotations

import httpx2
import trio

from tests.sglang import pairs, scenarios


async def test_router_aborts_with_the_admin_key(admin_pair, start_router):
    """A prefill 400 while the decode waits for KV: the router's abort must carry the admin
    key, so the engine accepts it (no 401 in the decode's log) and frees the decode in ms."""
    # The pair is shared by the module's tests; an earlier one shows the 401 on purpose, so
    # only what the engine logged during this test counts.
    log_start = len(admin_pair.decode.log_text())
    router = start_router(
        admin_pair,
        "--policy", "round_robin", "--disable-retries",
        "--api-key", pairs.API_KEY,
        "--worker-admin-api-key", pairs.ADMIN_API_KEY,
    )  # fmt: skip
    body = {"text": "word " * scenarios.LONG_PROMPT_WORDS, "sampling_params": {"max_new_tokens": 4}}
    # `--api-key` is also the key the router's clients present (SMG's meaning).
    auth = {"authorization": f"Bearer {pairs.API_KEY}"}
    # The provoked thing: the decode holds the request when the prefill's 400 comes. The legs
    # start together and the 400 is fast, so on a busy machine the decode leg may not have
    # written anything yet (then nothing is aborted, rightly): up to five requests, until one
    # reached the decode (its log shows the abort, whatever the answer to it).
    this_test = ""
    for _ in range(5):
        async with httpx2.AsyncClient(base_url=router.url, timeout=60, headers=auth) as client:
            r = await client.post("/generate", json=body)
        assert r.status_code == 400, r.text
        async with scenarios.client() as engines:
            await scenarios.wait_idle(
                engines, admin_pair.decode_url, timeout=2.0, key=pairs.API_KEY
            )
        await trio.sleep(0.5)
        this_test = admin_pair.decode.log_text()[log_start:]
        if '"POST /abort_request HTTP/1.1"' in this_test:
            break
    assert '"POST /abort_request HTTP/1.1" 200' in this_test  # the abort was sent ...
    assert '"POST /abort_request HTTP/1.1" 401' not in this_test  # ... and accepted
