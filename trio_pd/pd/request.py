"""A PD request as dispatch and the engines see it: the request, the router's context, the ranks.

What `dispatch.py` and the engine modules (`pd/engines/`) both read, below both, so an engine
module builds its attempts without importing dispatch.
"""

from __future__ import annotations

import random
from typing import Any

import attrs

from trio_pd.config import RouterConfig
from trio_pd.fleet.gates import Gates
from trio_pd.fleet.registry import Fleet
from trio_pd.fleet.worker import Hold, Worker
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.pd.aborts import AbortService
from trio_pd.pd.budget import Account
from trio_pd.pd.injection import dp_fields
from trio_pd.pd.payload import Inspected
from trio_pd.pd.trace import RequestTrace
from trio_pd.pd.vllm_bodies import VllmBodyMaker
from trio_pd.upstream.headers import generation_key, worker_authorization
from trio_pd.upstream.pool import UpstreamPool


@attrs.frozen
class PDRequest:
    """A validated client request: what dispatch needs to know of it, and its bytes."""

    path: str
    inspected: Inspected
    headers: list[tuple[bytes, bytes]]  # the legs' headers, less authorization
    authorization: bytes | None = None  # the client's, forwarded when a worker has no key
    request_id: str = ""
    routing_key: str | None = None  # read only when a policy routes by it (edge/routing_key.py)
    trace: RequestTrace | None = None  # its span (`--enable-trace`), else None
    account: Account | None = None  # its share of --max-buffered-bytes (budget.py)
    affinity: str | None = None  # consistent_hashing's key without a routing key (RouteHints)
    vllm: VllmBodyMaker | None = None  # its legs' bodies on vLLM pairs, made once (None: inline)
    parsers: Any = None  # trio_parallel.WorkerContext: large answers' JSON work (`offload.py`)


@attrs.frozen
class DispatchContext:
    """What dispatch reads from the router: one per process, shared by every request."""

    pool: UpstreamPool
    fleet: Fleet
    config: RouterConfig
    rng: random.Random
    metrics: RouterMetrics
    aborts: AbortService | None = None  # None: --no-abort-on-cancel
    # The prefill cap and the decode window (`fleet/gates.py`), one set per process.
    gates: Gates = attrs.field(
        default=attrs.Factory(lambda self: Gates(self.config.overload), takes_self=True)
    )


@attrs.frozen
class Ranks:
    """The DP ranks of one attempt (`--dp-aware`); None: the worker's engine chooses."""

    prefill: int | None = None
    decode: int | None = None
    prefill_dp: int = 1
    decode_dp: int = 1
    prefill_hold: Hold | None = None  # a RankHold, with a gate's slot when one applies
    decode_hold: Hold | None = None

    def release(self) -> None:
        for hold in (self.prefill_hold, self.decode_hold):
            if hold is not None:
                hold.release()

    @property
    def room_alignment(self) -> tuple[int, int]:
        """(dp_size, rank) rooms must agree with: `room % dp_size == rank` on the prefill."""
        return (self.prefill_dp, self.prefill or 0) if self.prefill is not None else (1, 0)

    @property
    def prefill_fields(self) -> dict[str, Any]:
        return dp_fields(self.prefill_dp, self.prefill or 0, self.decode_dp, self.decode or 0)[0]

    @property
    def decode_fields(self) -> dict[str, Any]:
        return dp_fields(self.prefill_dp, self.prefill or 0, self.decode_dp, self.decode or 0)[1]


def leg_headers_for(
    ctx: DispatchContext, request: PDRequest, worker: Worker
) -> list[tuple[bytes, bytes]]:
    key = generation_key(worker.spec, ctx.config.api_key)
    if not key and not request.authorization:
        return request.headers
    return [*request.headers, *worker_authorization(key, request.authorization)]
