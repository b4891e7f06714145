"""The /get_load answer: SGLang's load figures, plus per-rank ones on a data-parallel engine.

Top level (unchanged by dp_size): `num_reqs` (decode: slots taken + queued; prefill: requests in
flight), `num_waiting_reqs`, `num_tokens`. With dp_size > 1, `dp_loads` lists one such object per
rank (with `dp_rank`), counting batch items on the rank serving each of them.
"""

from __future__ import annotations

from typing import Any

from trio_pd.testing.engine.state import EngineState


def load_report(engine: EngineState) -> dict[str, Any]:
    report: dict[str, Any] = {
        "num_reqs": engine.running + engine.queued,
        "num_waiting_reqs": engine.queued,
        "num_tokens": engine.inflight_tokens,
    }
    if engine.config.dp_size > 1:
        report["dp_loads"] = rank_loads(engine)
    return report


def rank_loads(engine: EngineState) -> list[dict[str, Any]]:
    size = engine.config.dp_size
    items, tokens = [0] * size, [0] * size
    for call in engine.rids.owners():
        w = call.workload
        for index, rank in enumerate(call.dp_ranks):
            if rank is not None:
                items[rank] += 1
                tokens[rank] += len(w.inputs[index]) + w.max_new_tokens
    loads = []
    for rank in range(size):
        if engine.role == "decode":
            pool = engine.slots[rank]
            reqs, waiting = pool.running + pool.queued, pool.queued
        else:
            reqs, waiting = items[rank], 0
        loads.append(
            {
                "dp_rank": rank,
                "num_reqs": reqs,
                "num_waiting_reqs": waiting,
                "num_tokens": tokens[rank],
            }
        )
    return loads
