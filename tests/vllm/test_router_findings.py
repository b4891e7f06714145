"""Issue 27's findings that only the real engine shows, through trio_pd in front of the pair.

Each test first asserts the provoked thing happened (what the engines saw), then its effect.
"""

from __future__ import annotations

import http.server
import threading
import time

import httpx2

from tests.vllm import engines as E

FINISHED = "vllm:request_success_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"


class PassingThenDead:
    """A "decode" that passes the router's first health check (GET -> 200), then dies: its
    listener closes and every later connect is refused, nothing ever written to it."""

    def __init__(self) -> None:
        class Ok(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Ok)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def die(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


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
