"""Issue 27's findings that only the real engine shows, through trio_pd in front of the pair.

Each test first asserts the provoked thing happened (what the engines saw), then its effect.
"""

from __future__ import annotations

import time

import httpx2
import trio

from tests.vllm import engines as E
from tests.vllm.conftest import ROUTER_FLAGS
from trio_pd_testing.vllm.dead_decode import PassingThenDead

FINISHED = "vllm:request_success_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


async def test_a_dead_decode_pins_prefill_blocks_until_the_lease_at_most(
    pair, engines, start_router
):
    """Finding 1: the decode passed its health check, then died (connect refused, nothing
    written to it); health checks off, so the router still takes it for up; retries on.

    What the engines saw is measured and printed (prefills made, blocks held, freed by the
    lease); asserted: the provoked thing (a prefill answered, its blocks held for a read that
    never comes), one prefill only (5 before the fix: a retry is made only on a decode that has
    not failed the request, and there is no other here), and containment: every block is freed
    by the lease, none otherwise."""
    decode = PassingThenDead()
    try:
        router = start_router(
            pair, "--policy", "round_robin", "--disable-health-check", decodes=[decode.url]
        )
    finally:
        decode.die()
    p0 = await E.metrics(engines, pair.prefill_url)
    t0 = time.monotonic()
    async with httpx2.AsyncClient(base_url=router.url, timeout=120) as client:
        r = await client.post("/v1/completions", json=E.completion())
    answered = time.monotonic() - t0
    assert r.status_code in (502, 503), r.text
    p1 = await E.metrics(engines, pair.prefill_url)
    prefills = E.delta(p1, p0, FINISHED)
    held_after = p1.get("vllm:kv_cache_usage_perc", 0.0)
    freed, secs = await E.wait_kv_free(engines, pair.prefill_url)
    expired = E.delta(freed, p0, EXPIRED)
    print(
        f"\nfinding 1: client {r.status_code} after {answered:.2f} s; {prefills:.0f} prefills, "
        f"KV usage {held_after:.4f} after the answer, {expired:.0f} leases expired, all free "
        f"{secs:.1f} s after the answer"
    )
    # The provoked thing: a prefill answered and its blocks waited for a read never made.
    assert held_after > 0
    assert prefills == 1  # no fresh prefill leased for the same dead decode
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


LATE = "vllm:nixl_num_notifications_after_expiry_total"
XFERS = "vllm:nixl_xfer_time_seconds_count"


async def test_a_read_after_the_lease_answers_200_and_the_router_counts_it(
    pair, engines, start_router
):
    """Finding 4: a decode that reads after the prefill's lease expired reads blocks the
    prefill no longer holds for it, and answers 200 as usual. Provoked by what happened, not a
    clock: the decode is stopped (SIGSTOP) before the router sends it the handoff, so it neither
    reads nor sends heartbeats; once the prefill's own counter shows the lease expired, it is
    continued. Asserted: the read happened after the expiry (the prefill counted a notification
    for a request it no longer had), the client got a 200, and the router's
    `trio_pd_vllm_kv_reads_after_lease` counted it from the prefill's /metrics."""
    router = start_router(pair, *ROUTER_FLAGS, "--health-check-interval-secs", "1")
    p0 = await E.metrics(engines, pair.prefill_url)
    d0 = await E.metrics(engines, pair.decode_url)
    answers: list[httpx2.Response] = []

    async def send() -> None:
        async with httpx2.AsyncClient(base_url=router.url, timeout=300) as client:
            answers.append(await client.post("/v1/completions", json=E.completion()))

    async with trio.open_nursery() as nursery:
        with E.stopped(pair.decode):
            nursery.start_soon(send)
            # The prefill answered, and its lease expired with nothing read.
            await E.wait_for(
                engines,
                pair.prefill_url,
                lambda m: E.delta(m, p0, FINISHED) == 1 and E.delta(m, p0, EXPIRED) == 1,
                E.FREED_WITHIN_SECS,
                "the prefill's lease expired",
            )
    (r,) = answers
    d1 = await E.metrics(engines, pair.decode_url)
    # The prefill handles the decodes' notifications in its engine steps only: an idle prefill
    # counts the late read with its next request (checked: not within 60 s while idle). The
    # router's 1 s health checks saw the stopped decode fail: the nudge waits until they see it
    # answer again (a 503 "all 1 are unhealthy" otherwise, seen once).
    await E.wait_router(
        engines, router.metrics_url, "trio_pd_worker_healthy", lambda v: v == 1, "1",
        timeout=60.0, role="decode",
    )  # fmt: skip
    async with httpx2.AsyncClient(base_url=router.url, timeout=300) as client:
        nudge = await client.post("/v1/completions", json=E.completion("and then"))
    assert nudge.status_code == 200, nudge.text
    p1, _ = await E.wait_for(
        engines, pair.prefill_url, lambda m: E.delta(m, p0, LATE) >= 1, 60.0, "a late read"
    )
    print(
        f"\nfinding 4: client {r.status_code}; decode reads {E.delta(d1, d0, XFERS):.0f}, "
        f"prefill notifications after expiry {E.delta(p1, p0, LATE):.0f}"
    )
    assert E.delta(d1, d0, XFERS) >= 1  # the decode did read, after the lease
    assert r.status_code == 200, r.text  # and answered as if nothing happened
    counted = await E.wait_router(
        engines, router.metrics_url, "trio_pd_vllm_kv_reads_after_lease", lambda v: v >= 1, "1"
    )
    assert counted == E.delta(p1, p0, LATE)
    leases = await E.router_sum(engines, router.metrics_url, "trio_pd_vllm_kv_leases_expired")
    assert leases >= 1
    await E.wait_kv_free(engines, pair.prefill_url)
    await E.wait_kv_free(engines, pair.decode_url)


async def test_a_client_leaving_mid_prefill_frees_the_prefill_and_never_reaches_the_decode(
    pair, engines, start_router
):
    """The tiny model's prefill takes milliseconds, so the prefill engine is stopped (SIGSTOP)
    to make "mid-prefill" an event: the router's own metrics show its prefill leg in flight,
    the client leaves, the router closes the prefill's connection (its leg count back to 0),
    then the engine is continued. Asserted: the decode never received the request, and the
    prefill holds nothing at the end (whether it computed the abandoned request first, and
    whether the lease or the disconnect freed it, is printed)."""
    router = start_router(pair, *ROUTER_FLAGS)
    p0 = await E.metrics(engines, pair.prefill_url)
    d0 = await E.metrics(engines, pair.decode_url)
    in_flight = "trio_pd_worker_in_flight"
    with E.stopped(pair.prefill):
        async with trio.open_nursery() as nursery:

            async def send() -> None:
                async with httpx2.AsyncClient(base_url=router.url, timeout=300) as client:
                    await client.post("/v1/completions", json=E.completion())

            nursery.start_soon(send)
            await E.wait_router(
                engines, router.metrics_url, in_flight, lambda v: v == 1, "1", role="prefill"
            )
            nursery.cancel_scope.cancel()  # the client leaves
        await E.wait_router(
            engines, router.metrics_url, in_flight, lambda v: v == 0, "0", role="prefill"
        )
        assert await E.router_sum(engines, router.metrics_url, in_flight, role="decode") == 0
    p1, secs = await E.wait_kv_free(engines, pair.prefill_url)
    d1 = await E.metrics(engines, pair.decode_url)
    print(
        f"\nmid-prefill: prefill finished {E.delta(p1, p0, FINISHED):.0f}, prompt tokens "
        f"{E.delta(p1, p0, 'vllm:prompt_tokens_total'):.0f}, leases expired "
        f"{E.delta(p1, p0, EXPIRED):.0f}, free {secs:.1f} s after the continue"
    )
    for name in (FINISHED, "vllm:prompt_tokens_total", XFERS):
        assert E.delta(d1, d0, name) == 0, name  # the decode never received it
    assert d1.get("vllm:num_requests_running", 1) == 0
    assert d1.get("vllm:kv_cache_usage_perc", 1) == 0
