"""Reading a generation request's body and inspecting it, never stalling the event loop.

The body arrives within `--client-body-timeout-secs` or the request ends with 408 (a client
sending one byte a minute holds nothing for long). It is then inspected (`payload.inspect_body`):
inline when small, in a worker process when it is `OFFLOAD_BYTES` or more, because parsing JSON
costs up to ~0.3 µs per value and a few megabytes of tiny values would otherwise freeze every
stream this process relays for a large fraction of a second.
"""

from __future__ import annotations

import trio
import trio_parallel

from trio_pd.asgi import Receive, Scope, read_body
from trio_pd.errors import RouterError
from trio_pd.pd.payload import OFFLOAD_BYTES, Inspected, Refused, inspect_body


def body_timeout(secs: float) -> RouterError:
    return RouterError(408, f"the request body did not arrive within {secs:g}s", "timeout_error")


async def read_request_body(
    scope: Scope, receive: Receive, limit: int, within_secs: float
) -> bytes:
    """The whole body (413 past `limit`), or a 408 when it takes longer than `within_secs`."""
    with trio.move_on_after(within_secs):
        return await read_body(scope, receive, limit)
    raise body_timeout(within_secs)


async def inspect(
    path: str,
    raw: bytes,
    max_batch: int,
    owned_keys: frozenset[str],
    parsers: trio_parallel.WorkerContext | None,
) -> Inspected:
    """`inspect_body`, off the event loop for large bodies; raises the 4xx of a refused body."""
    if parsers is None or len(raw) < OFFLOAD_BYTES:
        result = inspect_body(path, raw, max_batch, owned_keys)
    else:
        result = await parsers.run_sync(
            inspect_body, path, raw, max_batch, owned_keys, kill_on_cancel=True
        )
    if isinstance(result, Refused):
        raise result.error()
    return result
