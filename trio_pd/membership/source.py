"""The membership interface every source implements, and the registry it feeds.

A source runs as one long-lived task in the app-lifespan nursery. Whenever its view changes
(and on a periodic resync) it calls ``registry.reconcile(source, desired)`` with the complete set
of workers it wants: the registry adds what is missing, removes what is gone (only among the
workers tagged with that source) and replaces a worker whose spec changed. Level-triggered: a
missed event is repaired by the next full set, never by replaying deltas.

Stores are the sources the admin API can write to (`POST /workers`, `DELETE /workers/{id}`):
in-memory for one process, the shared file for `--workers N`, etcd for replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import trio

from trio_pd.spec import Registry, WorkerRecord, WorkerSpec


class NotOwned(Exception):
    """The worker belongs to another membership source; change it there."""

    def __init__(self, worker_id: str, source: str) -> None:
        super().__init__(f"worker {worker_id!r} is managed by {source}; change it there")
        self.source = source


class StoreUnavailable(Exception):
    """The store cannot be read or written right now (a file or etcd that is unreachable)."""


class MembershipSource(Protocol):
    """A long-lived task keeping one source's workers in the registry."""

    name: str

    async def run(
        self, registry: Registry, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Reconcile forever; ``task_status.started()`` once the first attempt to read the
        source ended (with its workers, or with the source reported unreachable)."""


class MembershipStore(Protocol):
    """A source the admin API writes through (in-memory, shared file, etcd)."""

    name: str

    async def add(self, spec: WorkerSpec) -> WorkerRecord:
        """Register ``spec`` and return its record; ValueError if the URL and role exist,
        StoreUnavailable when the store cannot be written."""

    async def remove(self, worker_id: str) -> WorkerRecord:
        """Unregister a worker of this store; KeyError if it has no such worker, NotOwned if
        another source manages it."""

    def records(self) -> Mapping[str, WorkerRecord]:
        """The store's workers as last read, by id."""
