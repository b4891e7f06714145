"""Is a vLLM prefill's `kv_transfer_params` a handoff a decode may be given? (docs/vllm.md §1.2)

The router forwards the prefill's params to the decode as the prefill wrote them, and the decode
engine acts on them: it connects to `remote_host:remote_port` (NIXL's side channel) and reads
`remote_block_ids`. So a prefill's answer decides where a decode engine connects and what it
trusts, and two failures follow from forwarding it blindly (issue 27 finding 3, issue 26 N10):

- an incomplete handoff kills the decode engine: `{"do_remote_prefill": true}` without
  `remote_block_ids` ends in an `AssertionError` in vLLM 0.32's `nixl/pull_scheduler.py`, and
  every later request gets connection refused (measured against the real engine);
- `remote_host: 169.254.169.254` makes the decode engine call the metadata address, which the
  router itself refuses as a worker (`upstream/destinations.py`).

So before any decode sees it, the handoff must have what vLLM 0.32's pull connector reads
(`nixl/pull_scheduler.py` `update_state_after_alloc`, `nixl/base_scheduler.py`
`on_new_request`): `do_remote_prefill` true, a non-empty `remote_block_ids` (a list of block
ids, or 0.32's one list per KV-cache group) of non-negative integers, string
`remote_engine_id` and `remote_request_id`, a `remote_host` the router's own destination rule
allows a worker to be, a `remote_port` in 1-65535, a positive integer `tp_size`. Anything else
is the prefill's failure (502, retried on another prefill): never a decode's.
"""

from __future__ import annotations

from typing import Any

from trio_pd.upstream.destinations import DestinationRefused, Destinations

# Far more blocks than any context has (a 1 M-token context in 16-token blocks is 65,536).
MAX_BLOCK_IDS = 1 << 20


def _block_ids_problem(ids: Any) -> str | None:
    if not isinstance(ids, list) or not ids:
        return "remote_block_ids must be a non-empty list"
    groups = ids if all(isinstance(g, list) for g in ids) else [ids]
    count = 0
    for group in groups:
        for block in group:
            if isinstance(block, bool) or not isinstance(block, int) or block < 0:
                return f"remote_block_ids holds {block!r}, not a block id"
        count += len(group)
    if count == 0:
        return "remote_block_ids names no block"
    if count > MAX_BLOCK_IDS:
        return f"remote_block_ids names {count} blocks"
    return None


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def shape_problem(params: dict[str, Any]) -> str | None:
    """What vLLM's pull connector would choke on, or None."""
    if params.get("do_remote_prefill") is not True:
        return "do_remote_prefill is not true"
    problem = _block_ids_problem(params.get("remote_block_ids"))
    if problem is not None:
        return problem
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        value = params.get(key)
        if not isinstance(value, str) or not value or len(value) > 1024:
            return f"{key} must be a non-empty string"
    if not _int_in(params.get("remote_port"), 1, 65535):
        return f"remote_port {params.get('remote_port')!r} is not a port"
    if not _int_in(params.get("tp_size"), 1, 1 << 16):
        return f"tp_size {params.get('tp_size')!r} is not a tensor-parallel size"
    return None


async def handoff_problem(params: dict[str, Any], destinations: Destinations | None) -> str | None:
    """Why `params` may not go to a decode, or None. The host passes the rule a worker's URL
    passes at connect (resolved, every address checked; counted as a refusal of the legs)."""
    problem = shape_problem(params)
    if problem is not None or destinations is None:
        return problem
    host, port = params["remote_host"], params["remote_port"]
    try:
        await destinations.resolve(host.strip("[]"), port, "legs")
    except DestinationRefused as exc:
        return f"remote_host {host}: {exc}"
    except OSError as exc:
        return f"remote_host {host} does not resolve: {exc}"
    return None
