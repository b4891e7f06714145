"""Issue 27's findings that only the real engine shows, through trio_pd in front of the pair.

Each test first asserts the provoked thing happened (what the engines saw), then its effect.
"""

from __future__ import annotations

import time

import httpx2
import trio

from tests.vllm import engines as E
from trio_pd.testing.sglang.launcher import free_port, http_status

FINISHED = "vllm:request_success_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


async def test_a_dead_decode_pins_prefill_blocks_until_the_lease_at_most(
    pair, engines, start_router
):
    """Finding 1: the decode refuses connections (nothing is written to it), retries on.

    What the engines saw is measured and printed (prefills made, blocks held, freed by the
    lease); the bound asserted is containment: every block a doomed request pinned is free
    within the lease, and the prefill made at most one prefill per attempt."""
    dead = f"http://127.0.0.1:{free_port()}"
    # Health checks off: the router still takes the decode for up, as when it died after its
    # last check (with them on, the router answers 503 at once and no prefill is spent).
    router = start_router(
        pair, "--policy", "round_robin", "--disable-health-check", decodes=[dead], ready=False
    )
    deadline = time.monotonic() + 60
    while http_status(router.url + "/liveness") != 200:
        assert time.monotonic() < deadline, router.log()[-2000:]
        await trio.sleep(0.1)
    p0 = await E.metrics(engines, pair.prefill_url)
    t0 = time.monotonic()
    async with httpx2.AsyncClient(base_url=router.url, timeout=120) as client:
        r = await client.post("/v1/completions", json=E.completion())
    assert r.status_code in (502, 503), r.text
    p1 = await E.metrics(engines, pair.prefill_url)
    prefills = E.delta(p1, p0, FINISHED)
    held_after = p1.get("vllm:kv_cache_usage_perc", 0.0)
    freed, secs = await E.wait_kv_free(engines, pair.prefill_url)
    expired = E.delta(freed, p0, EXPIRED)
    print(
        f"\nfinding 1: client {r.status_code} after {time.monotonic() - t0:.2f} s; "
        f"{prefills:.0f} prefills, KV usage {held_after:.4f} after the answer, "
        f"{expired:.0f} leases expired, free {secs:.1f} s after the answer"
    )
    # The provoked thing: prefills answered and their blocks waited for a read that never came.
    assert prefills >= 1 and held_after > 0
    assert expired == prefills  # every one left to the lease: nothing read, nothing else freed


async def test_what_the_scale_out_abort_frees_of_a_prefill_that_answered(pair, engines):
    """Finding 2: a prefill that answered holds its blocks for a decode until the lease; the
    per-request abort (`POST /inference/v1/abort_requests`, `--enable-scale-out`) by the
    engine's external id (`cmpl-<x-request-id>-0`). Measured and printed; asserted: the abort
    is served, and the blocks are free within the lease either way."""
    p0 = await E.metrics(engines, pair.prefill_url)
    body = {
        **E.completion(max_tokens=1),
        "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False},
    }
    r = await engines.post(
        pair.prefill_url + "/v1/completions", json=body, headers={"x-request-id": "abortme"}
    )
    assert r.status_code == 200, r.text
    internal = r.json()["kv_transfer_params"]["remote_request_id"]
    held = (await E.metrics(engines, pair.prefill_url)).get("vllm:kv_cache_usage_perc", 0.0)
    assert held > 0  # the provoked thing: blocks waiting for a decode that will never come
    external = internal.rsplit("-", 1)[0]
    t0 = time.monotonic()
    a = await engines.post(
        pair.prefill_url + "/inference/v1/abort_requests", json={"request_ids": [external]}
    )
    assert a.status_code == 200, a.text
    freed, _ = await E.wait_kv_free(engines, pair.prefill_url)
    expired = E.delta(freed, p0, EXPIRED)
    print(
        f"\nfinding 2: abort of {external!r} (internal {internal!r}) answered {a.status_code}; "
        f"blocks free {time.monotonic() - t0:.2f} s later, leases expired {expired:.0f} "
        f"({'the lease, not the abort' if expired else 'the abort'} freed them)"
    )
