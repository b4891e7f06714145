"""Engine-aware admission of one attempt (docs/overload.md): its pair chosen through the prefill
gate, its rooms claimed in the decode's window, and the answers when either or the overload veto
says no. Never retried: each of them waited already, or clears only at the next load poll.

- every candidate overloaded, `--worker-overload-shed`: 503 `worker_overload_protection_shed`
  with Retry-After the load poll interval (SMG 1.13's code and header);
- the prefill line full, or no slot within `--prefill-queue-timeout-secs`: 429;
- no place in the decode's running window within `--pd-admission-wait-secs`: 503, the same
  code as the shed (SMG's `pd_admission` stage).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio

from trio_pd.errors import RouterError
from trio_pd.fleet.gates import Gates, QueueFull, QueueTimeout, Slot, WindowFull
from trio_pd.fleet.hints import RouteHints
from trio_pd.fleet.overload import Overloaded
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Worker
from trio_pd.observe.metrics import RouterMetrics

SHED_CODE = "worker_overload_protection_shed"


def shed_error(message: str, poll_interval_secs: float) -> RouterError:
    """503 with Retry-After: the load poll interval, since a veto cannot clear faster."""
    retry_after = str(max(1, math.ceil(poll_interval_secs))).encode()
    return RouterError(
        503, message, "service_unavailable", code=SHED_CODE,
        headers=((b"retry-after", retry_after),),
    )  # fmt: skip


def queue_error(message: str) -> RouterError:
    return RouterError(429, message, "rate_limit_error", code="prefill_queue_rejected")


async def admit_pair(
    fleet: Fleet,
    gates: Gates,
    metrics: RouterMetrics,
    hints: RouteHints,
    avoid: frozenset[Worker],
    poll_interval_secs: float,
) -> tuple[Worker, Worker, Slot | None]:
    """(prefill, decode, the prefill's slot): the pair chosen at once, or at the head of the
    prefill line with the cap on. NoWorkerAvailable passes through; the rest become errors."""
    gate = gates.prefill
    try:
        if gate is None:
            prefill, decode = fleet.select_pair(hints, avoid)
            return prefill, decode, None
        chosen: list[tuple[Worker, Worker]] = []

        def select(has_room: Callable[[Worker], bool]) -> Worker:
            pair = fleet.select_pair(hints, avoid, admit=has_room)
            chosen.append(pair)
            return pair[0]

        started = trio.current_time()
        outcome = "cancelled"
        try:
            slot = await gate.admit(select)
            outcome = "admitted"
        except QueueFull as exc:
            outcome = "full"
            raise queue_error(str(exc)) from None
        except QueueTimeout as exc:
            outcome = "timeout"
            raise queue_error(str(exc)) from None
        finally:
            waited = trio.current_time() - started
            metrics.gate_waits.labels("prefill", outcome).observe(waited)
        return chosen[-1][0], chosen[-1][1], slot
    except Overloaded as exc:
        raise shed_error(str(exc), poll_interval_secs) from None


async def admit_decode(
    gates: Gates, metrics: RouterMetrics, decode: Worker, rooms: int, poll_interval_secs: float
) -> Slot | None:
    """The attempt's rooms in the decode's running window (None: no gate applies)."""
    started = trio.current_time()
    outcome = "cancelled"
    try:
        slot = await gates.decode.admit(decode, rooms)
        outcome = "admitted"
    except WindowFull as exc:
        outcome = "timeout"
        raise shed_error(str(exc), poll_interval_secs) from None
    finally:
        waited = trio.current_time() - started
        if waited > 0 or outcome != "admitted":
            metrics.gate_waits.labels("decode", outcome).observe(waited)
    return slot
