"""Data-parallel ranks: which rank of an engine serves a request, which prefill rank has its KV.

SGLang (`--dp-size N`, DP attention) runs N ranks behind one URL. A request's body may pin the
rank serving it on that engine with `routed_dp_rank` (deprecated alias `data_parallel_rank`;
`routed_dp_rank` wins when both are given), and a decode request may name the PREFILL rank holding
its KV cache with `disagg_prefill_dp_rank`. Unpinned, both sides use `bootstrap_room % dp_size`
(the prefill's dp_size for the prefill rank), so they agree by construction; a pin on one side
only is how the two can disagree (the decode then waits for a KV cache that never comes).
"""

from __future__ import annotations

from typing import Any

import attrs

from trio_pd.testing.engine.workload import BadRequest


@attrs.frozen
class DpPins:
    """The rank fields of one request body (None: not given)."""

    routed: int | None = None  # routed_dp_rank / data_parallel_rank: this engine's rank
    prefill: int | None = None  # disagg_prefill_dp_rank: the prefill rank with the KV (decode)


def parse_pins(body: dict[str, Any]) -> DpPins:
    routed = body.get("routed_dp_rank")
    if routed is None:
        routed = body.get("data_parallel_rank")
    return DpPins(
        _rank(routed, "routed_dp_rank"),
        _rank(body.get("disagg_prefill_dp_rank"), "disagg_prefill_dp_rank"),
    )


def _rank(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise BadRequest(f"{name} must be a non-negative integer, not {value!r}")
    return value


def default_rank(room: int, dp_size: int) -> int:
    return room % dp_size


def serving_ranks(
    rooms: tuple[int, ...] | None, size: int, pins: DpPins, dp_size: int
) -> tuple[int | None, ...]:
    """The rank serving each item on this engine: the pin, else room % dp_size.

    None when neither is known (no room: the role flows refuse such requests anyway).
    """
    if pins.routed is not None:
        if pins.routed >= dp_size:
            raise BadRequest(
                f"routed_dp_rank {pins.routed} is out of range: this engine has dp_size {dp_size}"
            )
        return (pins.routed,) * size
    if rooms is None:
        return (None,) * size
    return tuple(default_rank(room, dp_size) for room in rooms)
