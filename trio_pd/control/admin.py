"""Membership routes: `POST /workers`, `GET /workers`, `GET /workers/{id}`,
`DELETE /workers/{id}` (who may call them: `auth.py`).

Changes go through the router's membership store (`membership/setup.py` chooses it): in one
process the Fleet itself, with `--workers N` the shared file every process reads, with etcd the
replicas' shared store. Answers: 409 for a URL and role already registered (by any source) and
for a worker another source manages (Kubernetes, flags under etcd); 400 for a spec the store
cannot hold (a per-worker api_key in etcd); 503 when the store cannot be written (etcd or the
file unreachable): nothing was changed, or, for a write that broke after it was sent, the watch
shows whether it landed.
A worker added at runtime starts unhealthy and takes traffic after the health checker's first
pass (the checker follows fleet membership). The answers have SMG 1.13's shape (`POST` and
`DELETE` answer 202 with `status`, `worker_id`, `location`; a worker shows `is_healthy` and
`status`; the listing has `stats`), with trio_pd's own fields beside them. A removed worker is
never selected again; requests already running on it finish. URLs that cannot be a worker
(link-local, cloud metadata, this router itself) are refused before anything is stored
(`upstream/destinations.py`).
"""

from __future__ import annotations

from typing import Any

import orjson
import trio

from trio_pd.asgi import Receive, Scope, json_reply, read_json_object
from trio_pd.control.context import ControlContext
from trio_pd.errors import RouterError, bad_request
from trio_pd.membership.etcd import EtcdError, UnstorableSpec
from trio_pd.membership.source import NotOwned, StoreUnavailable
from trio_pd.membership.worker_json import spec_from_json
from trio_pd.respond import JSON_HEADERS, Reply, Responder
from trio_pd.spec import WorkerSpec
from trio_pd.upstream.urls import check_destination

WORKERS_PATH = "/workers"
ADMIN_BODY_LIMIT = 64 * 1024


# -- membership --------------------------------------------------------------------------------


def parse_worker_spec(body: dict[str, Any]) -> WorkerSpec:
    """The `POST /workers` body: url, worker_type, bootstrap_port, model_id, api_key, checked
    as a membership file's entries are (`membership/worker_json.py`); a 400 saying what is
    wrong."""
    try:
        return spec_from_json(body)
    except ValueError as exc:
        raise bad_request(str(exc)) from None


async def read_spec(ctx: ControlContext, scope: Scope, receive: Receive) -> dict[str, Any]:
    """The body, within `--client-body-timeout-secs` as a generation request's (else 408): a
    client sending one byte a minute holds nothing for long."""
    secs = ctx.config.timeouts.client_body_secs
    with trio.move_on_after(secs):
        return await read_json_object(scope, receive, ADMIN_BODY_LIMIT)
    raise RouterError(408, f"the request body did not arrive within {secs:g}s", "timeout_error")


async def add_worker(ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder) -> None:
    spec = parse_worker_spec(await read_spec(ctx, scope, receive))
    await check_destination(spec.url, ctx.destinations, [tuple(scope["server"])])
    for known in ctx.fleet.workers(spec.role):  # any source's: a store sees only its own
        if known.url == spec.url:
            raise conflict(f"{spec.role} worker {spec.url} is already registered as {known.id}")
    try:
        record = await ctx.store.add(spec)
    except UnstorableSpec as exc:
        raise bad_request(str(exc)) from None
    except ValueError as exc:
        raise conflict(str(exc)) from None
    except (StoreUnavailable, EtcdError) as exc:
        raise unavailable(exc) from None
    try:
        shown = ctx.fleet.get(record.id).to_json()
    except KeyError:  # stored, but another source took the URL meanwhile (the log says which)
        shown = {"id": record.id, "url": spec.url, "worker_type": spec.role,
                 "bootstrap_port": spec.bootstrap_port, "source": record.source}  # fmt: skip
    rsp.audit = f"added {record.id} {spec.role} {spec.url}"
    location = f"{WORKERS_PATH}/{record.id}"
    # SMG 1.13's answer (202: the worker takes traffic once its first health check passes),
    # and the worker as it stands now.
    body = {**shown, "status": "accepted", "worker_id": record.id, "url": spec.url,
            "location": location,
            "message": "worker added; it takes traffic once its first health check passes",
            }  # fmt: skip
    headers = [*JSON_HEADERS, (b"location", location.encode())]
    await rsp.reply(Reply(202, headers, orjson.dumps(body)))


def conflict(message: str) -> RouterError:
    return RouterError(409, message, "conflict")


def unavailable(exc: Exception) -> RouterError:
    return RouterError(503, f"membership store unavailable: {exc}", "service_unavailable")


async def list_workers(ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder) -> None:
    """SMG 1.13's listing: `workers`, `total`, `stats` (counts by type)."""
    workers = ctx.fleet.to_json()
    stats = {f"{role}_count": sum(1 for w in workers if w["worker_type"] == role)
             for role in ("prefill", "decode")}  # fmt: skip
    body = {"workers": workers, "total": len(workers), "stats": {**stats, "regular_count": 0}}
    await json_reply(rsp, 200, body)


def worker_id_of(ctx: ControlContext, scope: Scope) -> str:
    worker_id = scope["path"][len(WORKERS_PATH) + 1 :]
    try:
        ctx.fleet.get(worker_id)
    except KeyError:
        raise RouterError(404, f"no worker {worker_id!r}", "not_found_error") from None
    return worker_id


async def get_worker(ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder) -> None:
    worker = ctx.fleet.get(worker_id_of(ctx, scope))
    await json_reply(rsp, 200, worker.to_json())


async def delete_worker(
    ctx: ControlContext, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    worker = ctx.fleet.get(worker_id_of(ctx, scope))
    try:
        await ctx.store.remove(worker.id)
    except (NotOwned, KeyError):
        if worker.source == ctx.store.name:  # removed meanwhile, through another replica
            raise RouterError(404, f"no worker {worker.id!r}", "not_found_error") from None
        raise conflict(
            f"worker {worker.id!r} is managed by {worker.source}; change it there"
        ) from None
    except (StoreUnavailable, EtcdError) as exc:
        raise unavailable(exc) from None
    rsp.audit = f"removed {worker.id} {worker.role} {worker.url}"
    body = {**worker.to_json(), "status": "accepted", "worker_id": worker.id,
            "message": "worker removed", "removed": True}  # fmt: skip
    await json_reply(rsp, 202, body)  # SMG 1.13's status
