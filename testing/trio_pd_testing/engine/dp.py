"""Data-parallel ranks: which rank of an engine serves a request, which prefill rank has its KV.

SGLang runs `dp_size x attn_dp_size` ranks behind one URL (config.num_dp_ranks). A request may
pin its rank on that engine with `routed_dp_rank` (deprecated alias `data_parallel_rank`;
`routed_dp_rank` wins; on the OpenAI routes an `X-Data-Parallel-Rank` header wins over both,
`serving_base.py`), and a decode request may name the PREFILL rank holding its KV cache with
`disagg_prefill_dp_rank`.

Unpinned, the DP controller (`managers/data_parallel_controller.py`) applies the engine's
`load_balance_method`: `follow_bootstrap_room` (the PD prefill's default) sends a request to
`bootstrap_room % N`; `round_robin` (the decode's default) takes the next rank in turn. The
simulator treats total_requests / total_tokens as round_robin.

A PD prefill with N > 1 under follow_bootstrap_room FAILS a room at once when the request was
pinned to another rank than `room % N` and carries no `disagg_prefill_dp_rank`
(`disaggregation/common/conn.py`: "follow_bootstrap_room conflict"); see prefill.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from trio_pd_testing.engine.config import EngineConfig
from trio_pd_testing.engine.workload import BadRequest, Refused


@attrs.frozen
class DpPins:
    """The rank fields of one request (None: not given)."""

    routed: int | None = None  # routed_dp_rank / data_parallel_rank / header: this engine's rank
    prefill: int | None = None  # disagg_prefill_dp_rank: the prefill rank with the KV


def parse_pins(body: dict[str, Any], header: str | None = None) -> DpPins:
    routed = body.get("routed_dp_rank")
    if routed is None:
        routed = body.get("data_parallel_rank")
    if header is not None:
        try:
            routed = int(header)
        except ValueError:
            raise BadRequest(
                f"Invalid X-Data-Parallel-Rank header: must be an integer, got '{header}'"
            ) from None
    return DpPins(
        _rank(routed, "routed_dp_rank"),
        _rank(body.get("disagg_prefill_dp_rank"), "disagg_prefill_dp_rank"),
    )


def _rank(value: Any, name: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise BadRequest(f"{name} must be an integer, not {value!r}")
    return value


def serving_ranks(
    rooms: tuple[int | None, ...],
    pins: DpPins,
    config: EngineConfig,
    next_round_robin: Callable[[], int],
) -> tuple[int | None, ...]:
    """The rank serving each item on this engine (None: no room to follow; refused later)."""
    ranks = config.num_dp_ranks
    if pins.routed is not None:
        if ranks <= 1 and pins.routed == 0:
            return (0,) * len(rooms)  # SGLang ignores it
        if not 0 <= pins.routed < ranks:
            raise Refused(f"routed_dp_rank={pins.routed} out of range [0, {ranks})")
        return (pins.routed,) * len(rooms)
    if pins.prefill is not None and pins.prefill < 0:
        raise BadRequest("disagg_prefill_dp_rank must be non-negative")
    if ranks == 1:
        return (0,) * len(rooms)
    if config.load_balance_method_resolved == "follow_bootstrap_room":
        return tuple(None if room is None else room % ranks for room in rooms)
    return tuple(next_round_robin() for _ in rooms)
