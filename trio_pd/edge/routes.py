"""The route table: every path the router answers, each bound to the narrow context it needs
and to the class of caller that may use it (`auth.py`)."""

from __future__ import annotations

from functools import partial

import attrs

from trio_pd.asgi import Handler
from trio_pd.control.admin import add_worker, delete_worker, get_worker, list_workers
from trio_pd.control.context import ControlContext, ControlHandler
from trio_pd.control.fanout import (
    handle_flush_cache,
    handle_get_loads,
    handle_health_generate,
    handle_models,
    proxy_from_prefill,
)
from trio_pd.edge.auth import AccessClass
from trio_pd.edge.drain import Drain
from trio_pd.edge.generation import GENERATION_PATHS, GenerationContext, handle_generation
from trio_pd.edge.probes import handle_liveness, handle_metrics, handle_readiness
from trio_pd.edge.supervision import ServiceGuard
from trio_pd.fleet.registry import Fleet
from trio_pd.observe.metrics import RouterMetrics


@attrs.frozen
class Route:
    """A handler, bound to the narrow context it needs, and who may call it (`auth.py`)."""

    handler: Handler
    access: AccessClass


def route_table(
    control: ControlContext,
    generation_context: GenerationContext,
    fleet: Fleet,
    drain: Drain,
    metrics: RouterMetrics,
    guard: ServiceGuard,
) -> dict[str, dict[str, Route]]:
    """Every route, each handler bound to the narrow context it needs."""

    def ctl(handler: ControlHandler, access: AccessClass) -> Route:
        return Route(partial(handler, control), access)

    generation = Route(partial(handle_generation, generation_context), "data")
    readiness = Route(partial(handle_readiness, fleet, drain), "open")
    liveness = Route(partial(handle_liveness, guard), "open")
    return {
        "/workers": {"GET": ctl(list_workers, "read"), "POST": ctl(add_worker, "write")},
        "/workers/{id}": {"GET": ctl(get_worker, "read"), "DELETE": ctl(delete_worker, "write")},
        "/flush_cache": {"POST": ctl(handle_flush_cache, "write")},
        "/get_loads": {"GET": ctl(handle_get_loads, "read")},
        "/health_generate": {"GET": ctl(handle_health_generate, "read")},
        "/get_model_info": {"GET": ctl(proxy_from_prefill, "read")},
        "/get_server_info": {"GET": ctl(proxy_from_prefill, "read")},
        # SGLang 0.5.23's names of the two (the get_ ones are its deprecated aliases).
        "/server_info": {"GET": ctl(proxy_from_prefill, "read")},
        "/model_info": {"GET": ctl(proxy_from_prefill, "read")},
        "/v1/models": {"GET": ctl(handle_models, "data")},
        **{path: {"POST": generation} for path in GENERATION_PATHS},
        # SMG's meanings: /health is liveness (its Helm chart probes it so), /readiness readiness.
        "/health": {"GET": liveness},
        "/readiness": {"GET": readiness},
        "/liveness": {"GET": liveness},
        "/metrics": {"GET": Route(partial(handle_metrics, metrics), "open")},
    }
