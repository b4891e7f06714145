"""The words every layer shares: a worker's role and spec, and a membership record.

A leaf: it imports nothing of the router, so the config, the fleet and every membership source
can name a worker without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Literal, Protocol

import attrs

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, Role] = ("prefill", "decode")  # a worker's roles, in the order shown
# Which PD protocol a worker speaks (docs/vllm.md §5): a pair never mixes engines.
Engine = Literal["sglang", "vllm"]
ENGINES: tuple[str, ...] = ("sglang", "vllm")


@attrs.frozen
class WorkerSpec:
    """One upstream engine: its base URL and, for prefill, the bootstrap port (None = no port).

    ``model_id`` names the model it serves (None: the router's only model); ``api_key`` is sent
    to this worker as `Authorization: Bearer` instead of the router-wide `--api-key`;
    ``admin_api_key`` is sent on its `/abort_request` instead of `--worker-admin-api-key` (an
    engine started with `--admin-api-key` takes only that key there, docs/protocol.md §10);
    ``engine`` is the PD protocol it speaks, known from configuration, never guessed.
    """

    url: str = attrs.field(converter=lambda u: u.rstrip("/"))
    role: Role
    bootstrap_port: int | None = None
    model_id: str | None = None
    api_key: str | None = attrs.field(default=None, repr=False)
    admin_api_key: str | None = attrs.field(default=None, repr=False)
    engine: Engine = "sglang"  # its PD protocol: SGLang's (concurrent legs) or vLLM's (sequential)


def _own_copy(meta: Mapping[str, str]) -> dict[str, str]:
    """A record keeps its own copy: the source may go on changing the mapping it built."""
    return dict(meta)


@attrs.frozen
class WorkerRecord:
    """One worker as a source wants it.

    ``id`` is agreed by every process and replica reading the same source (allocated by the
    store, or derived from the source's own names, such as a pod's), so `GET /workers/{id}`
    means the same worker everywhere. ``meta`` carries the source's own identity of the worker
    (pod name and uid, etcd key and revision) for `/workers` and logs.
    """

    id: str
    spec: WorkerSpec
    source: str
    meta: Mapping[str, str] = attrs.field(factory=dict, converter=_own_copy)


class Registry(Protocol):
    """What a source may do to the router's worker registry (the Fleet implements it)."""

    def reconcile(self, source: str, desired: Iterable[WorkerRecord]) -> None:
        """Make the workers tagged ``source`` exactly ``desired``; never touch other sources'."""

    def source_status(self, source: str, ok: bool, detail: str = "") -> None:
        """Report whether the source is reachable (readiness and metrics show it)."""
