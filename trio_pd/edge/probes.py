"""The probes: liveness, readiness and the metrics page."""

from __future__ import annotations

import os

from trio_pd.asgi import Receive, Scope, json_reply
from trio_pd.edge.drain import Drain
from trio_pd.edge.supervision import ServiceGuard
from trio_pd.fleet.registry import Fleet
from trio_pd.observe.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trio_pd.observe.metrics import RouterMetrics
from trio_pd.respond import Reply, Responder


async def handle_liveness(
    guard: ServiceGuard, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    """`/liveness` and `/health`: the process is alive, and which process answered (with
    `--workers N` each has its own). As SMG's `/health`: 200 while the process runs, through a
    drain too (Kubernetes must not kill a draining router), whatever its workers do; 503 only
    once the process gave up on itself (its services died, `edge/supervision.py`) and is on
    its way out, so an orchestrator restarts it even if the exit were slow."""
    if guard.failed is not None:
        error = {"message": guard.failed, "type": "service_unavailable", "code": 503}
        await json_reply(rsp, 503, {"status": "failed", "error": error, "pid": os.getpid()})
        return
    await json_reply(rsp, 200, {"status": "alive", "pid": os.getpid()})


async def handle_readiness(
    fleet: Fleet, drain: Drain, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    """`/readiness`: 200 only when a prefill and a decode can take traffic (breakers aside:
    see `Fleet.select`'s panic routing) and the process is not draining. SMG 1.13's body
    (`status` ready / not ready, `healthy_workers`, `total_workers`, `reason`), with the error
    envelope on a 503.

    A membership source that cannot be read (etcd or the Kubernetes API server down) does not
    make the router unready: the replica keeps routing to the last membership it knew, and an
    etcd outage reaches every replica at once, so a 503 here would take the whole Service out of
    its endpoints because of a control-plane blip while every worker still serves. The answer
    says so instead: `"membership": {"etcd": "down"}` and `"degraded": true` (the details are in
    the log and `trio_pd_membership_source_up`).
    """
    if drain.draining:
        error = {"message": "shutting down", "type": "service_unavailable", "code": 503}
        body: dict[str, object] = {"status": "not ready", "reason": "draining", "error": error}
        await json_reply(rsp, 503, body)
        return
    membership = {name: "up" if ok else "down" for name, (ok, _) in fleet.sources.items()}
    extra: dict[str, object] = {"membership": membership} if membership else {}
    kv_states = fleet.kv_states()
    if kv_states:  # kv_aware: each prefill's KV-event state; any not precise degrades
        extra["kv_events"] = kv_states
    workers = fleet.workers()
    counts: dict[str, object] = {
        "healthy_workers": sum(1 for w in workers if w.healthy and not w.removed),
        "total_workers": len(workers),
    }
    missing = [role for role in ("prefill", "decode") if not fleet.routable(role)]
    if missing or fleet.unpaired_engines() or fleet.incompatible_backends():
        if missing:
            message = f"no available {' or '.join(missing)} worker"
            reason = "insufficient healthy workers"
        elif not fleet.unpaired_engines():
            message = "no healthy prefill and decode worker with the same KV transfer backend"
            reason = "no_compatible_pd_pair"
        else:
            message = "no healthy prefill and decode worker of the same engine (sglang, vllm)"
            reason = "no prefill and decode of one engine"
        error = {"message": message, "type": "service_unavailable", "code": 503}
        body = {"status": "not ready", "reason": reason, **counts}
        await json_reply(rsp, 503, {**body, "error": error, **extra})
    else:
        if "down" in membership.values() or any(s != "precise" for s in kv_states.values()):
            extra["degraded"] = True
        await json_reply(rsp, 200, {"status": "ready", **counts, **extra})


async def handle_metrics(
    metrics: RouterMetrics, scope: Scope, receive: Receive, rsp: Responder
) -> None:
    body = metrics.render()
    await rsp.reply(Reply(200, [(b"content-type", METRICS_CONTENT_TYPE)], body))
