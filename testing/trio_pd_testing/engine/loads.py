"""GET /v1/loads (SGLang 0.5.23's load endpoint) and, behind an option, the old GET /get_load.

The shape is `entrypoints/v1_loads.py`: `{"timestamp": ISO-8601 UTC, "version", "accelerator",
"num_accelerators", "loads": [one snapshot per DP rank]}`; a snapshot is
`managers/load_snapshot.py` `LoadSnapshot.to_dict`: every core key always, then the sections
`memory`, `disaggregation`, `queues` (speculative and lora are None on this engine, so never
shown). `?include=core,disagg,...` picks sections (core alone: core keys only); `?dp_rank=R`
one rank (out of range: no loads); `?format=prometheus` the text format.

An invalid section name: SGLang validates it inside `LoadSnapshot.to_dict`, which
v1_loads.get_loads calls OUTSIDE its `try ... except ValueError -> 400`, so the engine answers
a bare 500 "Internal Server Error". The simulator answers that too (the code is the final word).

The figures, per rank, as `scheduler_components/load_inquirer.py` computes them from the
scheduler's queues (state.py stages):
- decode: num_running_reqs = generating; num_waiting_reqs = waiting queue + prealloc +
  transfer (+ retracted, never here), i.e. on a PD decode mostly the requests still WAITING
  FOR THEIR KV CACHE;
  num_used_tokens = KV held (transfer + running + aborted transfers whose pages are still held,
  see decode.py); num_total_tokens adds the prealloc queue's tokens; num_active_tokens takes
  away those of prealloc + transfer (KV not arrived).
  `EngineState.saturate` adds another router's requests: queued ones to the waiting queue
  (`queues.waiting`, num_waiting_reqs), running ones, and KV held (token_usage).
- prefill: num_running_reqs = computing; num_waiting_reqs = bootstrap queue (waiting for the
  decode's registration); num_used_tokens = KV of the requests computing.
"""

from __future__ import annotations

import datetime
import time
from typing import Any
from urllib.parse import parse_qs

from trio_pd_testing.engine.config import SGLANG_VERSION
from trio_pd_testing.engine.state import EngineState, Item

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


class InvalidSection(ValueError):
    pass


def v1_loads(engine: EngineState, query: bytes) -> tuple[int, Any]:
    """(status, body): body is a dict for JSON, a str for the Prometheus text format."""
    params = parse_qs(query.decode("latin-1"))
    rank_text = params.get("dp_rank", [None])[0]
    include_text = params.get("include", [None])[0]
    include = [s.strip() for s in include_text.split(",")] if include_text else None
    ranks = list(range(engine.config.num_dp_ranks))
    if rank_text is not None:
        try:
            rank = int(rank_text)
        except ValueError:
            return 400, _validation_error("dp_rank", rank_text)
        ranks = [rank] if 0 <= rank < engine.config.num_dp_ranks else []
    snapshots = [{**snapshot(engine, rank), **engine.load_lie} for rank in ranks]
    try:
        loads = [select(s, set(include) if include else None) for s in snapshots]
    except InvalidSection:
        return 500, "Internal Server Error"
    if params.get("format", [None])[0] == "prometheus":
        return 200, prometheus(loads)
    return 200, {
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": None,  # get_device_name(): no GPU here
        "num_accelerators": num_accelerators(engine),
        "loads": loads,
    }


def num_accelerators(engine: EngineState) -> int:
    """Accelerators behind one DP rank (v1_loads._num_accelerators_per_dp_rank)."""
    cfg = engine.config
    count = cfg.tp_size_resolved  # x pp_size (1)
    if cfg.attn_dp_size_resolved > 1:
        count //= cfg.num_dp_ranks
    return count


def _validation_error(name: str, value: str) -> dict[str, Any]:
    message = (
        f"[{{'type': 'int_parsing', 'loc': ('query', '{name}'), 'msg': 'Input should be a "
        f"valid integer, unable to parse string as an integer', 'input': '{value}'}}]"
    )
    return {
        "object": "error",
        "message": message,
        "type": "Bad Request",
        "param": None,
        "code": 400,
    }


def _items(engine: EngineState, rank: int, *stages: str) -> list[Item]:
    return [i for i in engine.live if i.rank == rank and i.stage in stages]


def snapshot(engine: EngineState, rank: int) -> dict[str, Any]:
    """One rank's LoadSnapshot as a dict with every section (select() trims it)."""
    cfg = engine.config
    decode = engine.role == "decode"
    running = _items(engine, rank, "running")
    if decode:
        prealloc = _items(engine, rank, "prealloc")
        transfer = _items(engine, rank, "transfer")
        queue = _items(engine, rank, "waiting")  # KV arrived, not yet running
        waiting = queue + prealloc + transfer
        held = [i for i in engine.deferred if i.rank == rank]
        used = sum(i.held_tokens for i in (*transfer, *queue, *running, *held))
        total = used + sum(i.seqlen for i in prealloc)
        active = max(0, total - sum(i.seqlen for i in (*prealloc, *transfer)))
        ready = [i for i in prealloc if i.waiting_for_input]
        bootstrap_q, inflight = 0, 0
    else:
        bootstrap = _items(engine, rank, "bootstrap")
        waiting, transfer, prealloc, ready, queue = bootstrap, [], [], [], []
        used = sum(i.held_tokens for i in (*running, *_items(engine, rank, "inflight")))
        total = used + sum(i.seqlen for i in bootstrap)
        active = total
        bootstrap_q, inflight = len(bootstrap), len(_items(engine, rank, "inflight"))
    max_running = cfg.max_running
    extra = engine.extra_queued  # another router's load (EngineState.saturate)
    used = min(cfg.max_total_tokens, used + engine.extra_used_tokens)
    total += engine.extra_used_tokens
    active += engine.extra_used_tokens
    running_count = len(running) + engine.extra_running
    return {
        "timestamp": time.time(),
        "dp_rank": rank,
        "num_running_reqs": running_count,
        "num_waiting_reqs": len(waiting) + extra,
        "num_waiting_uncached_tokens": 0,  # the prefill's waiting queue: not modelled (empty)
        "num_used_tokens": used,
        "num_total_tokens": total,
        "num_active_tokens": active,
        "num_prealloc_ready_tokens": sum(i.seqlen for i in ready),
        "max_total_num_tokens": cfg.max_total_tokens,
        "max_running_requests": max_running,
        "token_usage": round(used / cfg.max_total_tokens, 4),
        "gen_throughput": 0.0,
        "cache_hit_rate": 0.0,
        "utilization": round(running_count / max_running, 4),
        "total_prefill_uncached_tokens": 0 if decode else engine.prefill_uncached_tokens,
        "total_prefill_busy_us": 0 if decode else engine.prefill_busy_us,
        # null until the decode has run a step (load_inquirer.py: `totals[0] > 0`)
        "decode_moments": list(engine.decode_moments) if engine.decode_moments[0] > 0 else None,
        "memory": {
            "weight_gb": 0.0,
            "kv_cache_gb": 0.0,
            "graph_gb": 0.0,
            "token_capacity": cfg.max_total_tokens,
        },
        "disaggregation": {
            "mode": engine.role,
            "prefill_bootstrap_queue_reqs": bootstrap_q,
            "prefill_inflight_queue_reqs": inflight,
            "decode_prealloc_queue_reqs": len(prealloc),
            "decode_transfer_queue_reqs": len(transfer),
            "decode_retracted_queue_reqs": 0,
            "kv_transfer_speed_gb_s": 0.0,
            "kv_transfer_latency_ms": 0.0,
        },
        "queues": {
            "waiting": len(queue) + extra,
            "grammar": 0,
            "paused": 0,
            "retracted": 0,
            "prealloc_ready": len(ready),
        },
    }


_SECTION_KEYS = {"memory": "memory", "disaggregation": "disagg", "queues": "queues"}


def select(snap: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    """LoadSnapshot.to_dict(include)."""
    core = {k: v for k, v in snap.items() if k not in _SECTION_KEYS}
    if include is None or "all" in include:
        return snap
    if not include <= SECTIONS:
        raise InvalidSection(include - SECTIONS)
    if include == {"core"}:
        return core
    return {**core, **{k: snap[k] for k, name in _SECTION_KEYS.items() if name in include}}


def prometheus(loads: list[dict[str, Any]]) -> str:
    """v1_loads._format_loads_prometheus: one gauge per figure, labelled by dp_rank."""
    prefixes = {"disaggregation": "disagg"}
    samples: dict[str, list[tuple[int, Any]]] = {}
    for load in loads:
        load = dict(load)
        rank = load.pop("dp_rank")
        for key, value in load.items():
            if isinstance(value, dict):
                prefix = prefixes.get(key, key)
                for sub, sub_value in value.items():
                    if isinstance(sub_value, int | float) and not isinstance(sub_value, bool):
                        samples.setdefault(f"sglang_{prefix}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines += [f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values]
    return "\n".join(lines) + "\n"


def legacy_get_load(engine: EngineState) -> Any:
    """GET /get_load of SGLang before 0.5.23 (`--legacy-load-endpoint` only): the top-level
    counts, and per-rank `dp_loads` on a data-parallel engine (as this simulator served it)."""
    loads = [snapshot(engine, rank) for rank in range(engine.config.num_dp_ranks)]

    def old(load: dict[str, Any]) -> dict[str, Any]:
        return {
            "num_reqs": load["num_running_reqs"] + load["num_waiting_reqs"],
            "num_waiting_reqs": load["num_waiting_reqs"],
            "num_tokens": load["num_total_tokens"],
        }

    report = {
        "num_reqs": sum(old(x)["num_reqs"] for x in loads),
        "num_waiting_reqs": sum(x["num_waiting_reqs"] for x in loads),
        "num_tokens": sum(x["num_total_tokens"] for x in loads),
    }
    if engine.config.num_dp_ranks > 1:
        report["dp_loads"] = [{"dp_rank": x["dp_rank"], **old(x)} for x in loads]
    return report
