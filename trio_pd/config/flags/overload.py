"""Engine-aware admission on the PD path (docs/overload.md): SMG 1.13's flags, names and
defaults. The overload veto reads the engines' `/v1/loads`; the prefill cap and its FIFO queue
count the router's own legs; the decode gate counts rooms against the engine's running window."""

from __future__ import annotations

from trio_pd.config.flags.flag import SWITCH, Flag

OVERLOAD: tuple[Flag, ...] = (
    Flag(
        "--disable-worker-overload-protection",
        "route to a worker whatever its engine reports (no overload veto; loads are then polled "
        "only for power_of_two and least_load)",
        "overload.protection",
        action=SWITCH,
        invert=True,
    ),
    Flag(
        "--worker-overload-waiting-requests",
        "a worker whose engine reports this many requests queued for compute (summed over DP "
        "ranks) is left out of routing while another candidate is under the thresholds; on a PD "
        "decode, requests waiting for their KV cache, and on a PD prefill those waiting for "
        "their decode's handshake, are normal PD operation and not counted (SMG 1.13 counts "
        "them; docs/overload.md)",
        "overload.waiting_requests",
        default=8,
        type=int,
        # Not a `differs` note (those are for sglang-router 0.3.2's flags): SMG 1.13 counts a
        # decode's KV waiters too, which vetoes a healthy decode in ordinary PD operation.
    ),
    Flag(
        "--worker-overload-token-usage",
        "a worker whose engine reports this KV token usage or more (0-1, mean over DP ranks) "
        "is left out of routing while another candidate is under the thresholds",
        "overload.token_usage",
        default=0.8,
        type=float,
    ),
    Flag(
        "--worker-overload-shed",
        "when every candidate is over the thresholds, answer 503 with Retry-After instead of "
        "sending the request to the least loaded",
        "overload.shed",
        action=SWITCH,
    ),
    Flag(
        "--prefill-max-inflight-requests-per-worker",
        "at most this many of the router's prefill legs on one prefill worker; more wait in a "
        "FIFO queue; a slot is freed when the prefill leg ends (<= 0: no cap)",
        "overload.prefill_max_inflight",
        default=-1,
        type=int,
    ),
    Flag(
        "--prefill-queue-size",
        "with the prefill cap: requests waiting for a prefill slot, at most (more: 429); "
        "default 100",
        "overload.prefill_queue_size",
        type=int,
    ),
    Flag(
        "--prefill-queue-timeout-secs",
        "with the prefill cap: longest wait for a prefill slot (then 429); default 60",
        "overload.prefill_queue_timeout_secs",
        type=float,
    ),
    Flag(
        "--pd-admission-wait-secs",
        "how long a dispatch waits for a place in the decode's running window "
        "(max_running_requests x DP width, as the engine reports it) before a 503; 0: no gate "
        "(SMG 1.13: gRPC only, 0 sheds at once; docs/overload.md)",
        "overload.pd_admission_wait_secs",
        default=30,
        type=float,
    ),
)
