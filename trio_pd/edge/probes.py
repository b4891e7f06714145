"""The probes: liveness, readiness and the metrics page."""

from __future__ import annotations

import os

from trio_pd.asgi import Receive, Scope, json_reply
from trio_pd.edge.drain import Drain
from trio_pd.fleet.registry import Fleet
from trio_pd.observe.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.respond import Reply, Responder


async def handle_liveness(scope: Scope, receive: Receive, rsp: Responder) -> None:
    """Alive, and which process answered (with `--workers N` each process has its own)."""
    await json_reply(rsp, 200, {"status": "alive", "pid": os.getpid()})


async def handle_health(
    fleet: Fleet, drain: Drain, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    """200 only when a prefill and a decode can take traffic (breakers aside: see
    `Fleet.select`'s panic routing) and the process is not draining.

    A membership source that cannot be read (etcd or the Kubernetes API server down) does not
    make the router unready: the replica keeps routing to the last membership it knew, which is
    what the issue asks, and an etcd outage reaches every replica at once, so a 503 here would
    take the whole Service out of its endpoints because of a control-plane blip while every
    worker still serves. The answer says so instead: `"status": "degraded"` and `"membership":
    {"etcd": "down"}` (the details are in the log and `trio_pd_membership_source_up`).
    """
    if drain.draining:
        error = {"message": "shutting down", "type": "service_unavailable", "code": 503}
        await json_reply(rsp, 503, {"status": "draining", "error": error})
        return
    membership = {name: "up" if ok else "down" for name, (ok, _) in fleet.sources.items()}
    extra = {"membership": membership} if membership else {}
    missing = [role for role in ("prefill", "decode") if not fleet.routable(role)]
    if missing:
        error = {
            "message": f"no available {' or '.join(missing)} worker",
            "type": "service_unavailable",
            "code": 503,
        }
        await json_reply(rsp, 503, {"status": "unavailable", "error": error, **extra})
    else:
        status = "degraded" if "down" in membership.values() else "ok"
        await json_reply(rsp, 200, {"status": status, **extra})


async def handle_metrics(
    metrics: RouterMetrics, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    body = metrics.render()
    await rsp.reply(Reply(200, [(b"content-type", METRICS_CONTENT_TYPE)], body))
