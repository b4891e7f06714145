"""Which membership store and sources a router runs: decided here, and only here.

The store is where the admin API writes (`POST /workers`, `DELETE /workers/{id}`); the sources are
the long-lived tasks feeding the Fleet (`edge/services.py` runs each under the crash-only guard).

- `--etcd-endpoints`: etcd is the store and a source. Admin changes on any replica are written
  to etcd and reach every replica through its watch (`membership/etcd/`).
- `--membership-file PATH`, or `--workers N` without etcd (the parent then makes the file): the
  file is the store and a source (`membership/shared_file.py`).
- otherwise the Fleet itself is the store (`membership/memory.py`): admin workers live in this
  process only.
- `--discovery-provider file --discovery-file F` (SMG 1.13's) adds a read-only source reading
  SMG's manifest (`membership/manifest.py`), whichever the store, as Kubernetes does.
- `--service-discovery` adds a `KubernetesDiscovery` source, whichever the store: it is
  read-only, so admin changes to its workers are refused (409, `NotOwned`), and admin adds go to
  the store.

The command line's `--prefill`/`--decode` workers stay source "static" in the Fleet, except with
a membership file, where they are written into the file (so `--workers N` processes agree on
their ids). Every source only ever adds and removes its own workers (`Fleet.reconcile`), so
flags, Kubernetes and etcd run side by side without fighting; a worker two sources name (same
URL and role) belongs to the first that registered it.

`--workers N` with etcd or Kubernetes: every process runs its own watch. They agree because the
source is the same and the ids come from it (etcd keys, pod names), exactly as separate replicas
agree; no file is involved for etcd (`serve/supervisor.py` `per_process`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from trio_pd.config import RouterConfig
from trio_pd.fleet.registry import Fleet
from trio_pd.membership.etcd import SOURCE as etcd_source
from trio_pd.membership.etcd import EtcdMembership
from trio_pd.membership.kubernetes import SOURCE as kubernetes_source
from trio_pd.membership.kubernetes import KubernetesDiscovery
from trio_pd.membership.manifest import RESYNC_SECS as MANIFEST_RESYNC_SECS
from trio_pd.membership.manifest import SOURCE as manifest_source
from trio_pd.membership.manifest import smg_manifest
from trio_pd.membership.memory import MemoryStore
from trio_pd.membership.shared_file import SOURCE as file_source
from trio_pd.membership.shared_file import FileMembership
from trio_pd.membership.source import MembershipSource, MembershipStore
from trio_pd.spec import WorkerSpec
from trio_pd.upstream.destinations import Destinations
from trio_pd.upstream.urls import refuse_listed

if TYPE_CHECKING:
    from trio_pd.observe.metrics import RouterMetrics


@attrs.frozen
class Membership:
    store: MembershipStore  # where the admin API writes
    sources: tuple[MembershipSource, ...]  # long-lived readers, in start order


def error_counter(metrics: RouterMetrics, source: str) -> Callable[[str], None]:
    """A source's ``on_error(kind)``: `trio_pd_membership_errors_total{source,kind}`."""
    counter = metrics.membership_errors

    def on_error(kind: str) -> None:
        counter.labels(source, kind).inc()

    return on_error


def membership_for(
    config: RouterConfig,
    fleet: Fleet,
    metrics: RouterMetrics,
    destinations: Destinations | None = None,
) -> Membership:
    """The store and the sources ``config`` asks for (see the module doc). With
    `destinations`, a file's entry pointing where no worker may is skipped as it is read."""
    sources: list[MembershipSource] = []
    check = None
    if destinations is not None:
        rule = destinations

        def check(spec: WorkerSpec) -> None:
            refuse_listed(spec.url, rule)

    store: MembershipStore
    if config.etcd is not None:
        if config.membership_file:
            raise ValueError("--etcd-endpoints and --membership-file are two stores: pick one")
        etcd = EtcdMembership(config.etcd, on_error=error_counter(metrics, etcd_source))
        store = etcd
        sources.append(etcd)
    elif config.membership_file:
        shared = FileMembership(
            Path(config.membership_file), fleet, on_error=error_counter(metrics, file_source),
            check=check,
        )  # fmt: skip
        store = shared
        sources.append(shared)
    else:
        store = MemoryStore(fleet)
    if config.discovery_provider == "file" and config.discovery_file:
        manifest = FileMembership(
            Path(config.discovery_file), fleet, name=manifest_source, read=smg_manifest,
            resync_secs=config.discovery_check_interval_secs or MANIFEST_RESYNC_SECS,
            on_error=error_counter(metrics, manifest_source), check=check,
        )  # fmt: skip
        sources.append(manifest)
    if config.kubernetes is not None:
        on_error = error_counter(metrics, kubernetes_source)
        sources.append(KubernetesDiscovery(config.kubernetes, on_error=on_error))
    return Membership(store, tuple(sources))
