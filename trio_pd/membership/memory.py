"""The admin API's store for one process: membership kept in the Fleet itself.

`POST /workers` adds a worker tagged "admin"; `DELETE /workers/{id}` removes an admin worker or
one from the command line ("static"); workers of other sources (Kubernetes, etcd) belong to
those sources and are refused (409): removing them here would only last until their next resync.
"""

from __future__ import annotations

from collections.abc import Mapping

from trio_pd.fleet.registry import Fleet
from trio_pd.membership.source import NotOwned
from trio_pd.spec import WorkerRecord, WorkerSpec

ADMIN = "admin"
OWNED = ("admin", "static")


class MemoryStore:
    name = ADMIN

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def add(self, spec: WorkerSpec) -> WorkerRecord:
        worker = self.fleet.add(spec, source=ADMIN)  # ValueError if the URL and role exist
        return WorkerRecord(worker.id, spec, ADMIN)

    async def remove(self, worker_id: str) -> WorkerRecord:
        worker = self.fleet.get(worker_id)  # KeyError if unknown
        if worker.source not in OWNED:
            raise NotOwned(worker_id, worker.source)
        self.fleet.remove(worker_id)
        return WorkerRecord(worker.id, worker.spec, worker.source)

    def records(self) -> Mapping[str, WorkerRecord]:
        return {
            w.id: WorkerRecord(w.id, w.spec, w.source)
            for w in self.fleet.workers()
            if w.source in OWNED
        }
