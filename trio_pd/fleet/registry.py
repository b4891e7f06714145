"""The worker registry: who is up, who is loaded, and which worker a request leg goes to.

Pure bookkeeping plus trio timing; nothing here knows HTTP. Not thread-safe: one trio run owns it.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import trio

from trio_pd.config import RouterConfig
from trio_pd.fleet.breaker import CircuitBreaker
from trio_pd.fleet.gates import AtCapacity
from trio_pd.fleet.hints import NO_HINTS, RouteHints
from trio_pd.fleet.overload import Overloaded, veto
from trio_pd.fleet.policies import Policy, make_policy
from trio_pd.fleet.worker import Hold, NoWorkerAvailable, Tracked, Worker
from trio_pd.spec import ROLES, Role, WorkerRecord, WorkerSpec

if TYPE_CHECKING:
    from trio_pd.fleet.kv_aware import KvAwarePolicy

log = logging.getLogger(__name__)

NO_COMPATIBLE_PAIR = "no_compatible_pd_pair"  # SMG 1.13's error code for it


def pairable(prefill: Worker, decode: Worker) -> bool:
    """Whether their KV caches can move between them: SMG 1.13's default (lenient) pairing
    refuses a known difference of transfer backend (`disaggregation_transfer_backend` of their
    /server_info); a backend a worker does not report pairs with any."""
    a, b = prefill.server_info.transfer_backend, decode.server_info.transfer_backend
    return a is None or b is None or a == b


class Fleet:
    """All workers of one router, one selection policy per role.

    Membership changes bump `version` and wake `wait_changed()`; the health checker follows them.
    """

    def __init__(
        self,
        config: RouterConfig,
        rng: random.Random | None = None,
        *,
        static: bool = True,
        on_panic: Callable[[Role], None] | None = None,
        on_overload: Callable[[Role, str], None] | None = None,
        on_load_rejected: Callable[[Worker, str], None] | None = None,
    ) -> None:
        self.config = config
        self.rng = rng or random.Random()
        self.policies: dict[Role, Policy] = {
            role: make_policy(config.policy.for_role(role), config.policy, self.rng)
            for role in ROLES
        }
        self._workers: dict[str, Worker] = {}
        self._serial: dict[Role, int] = dict.fromkeys(ROLES, 0)
        self.version = 0
        self._changed = trio.Event()
        self.panics: dict[Role, int] = dict.fromkeys(ROLES, 0)  # selections in panic routing
        self.on_panic = on_panic  # e.g. a metric
        self.on_overload = on_overload  # (role, "vetoed" | "fallback" | "shed"): a metric
        self.on_load_rejected = on_load_rejected  # (worker, reason): a metric
        self.sources: dict[str, tuple[bool, str]] = {}  # source -> (reachable, detail)
        self._models: tuple[int, list[str]] | None = None
        self._shadowed: set[str] = set()  # aliases a served model's name overrides (logged)
        # An engine's reported load (GET /get_loads, the polling of `fleet/loads.py`) counts
        # until the poll after next would have replaced it.
        self.load_fresh_secs = 2 * max(config.health.interval_secs, config.load_poll_interval_secs)
        if static:  # with a shared membership store the static workers live in the store
            for spec in (*config.prefill, *config.decode):
                self.add(spec)

    # -- membership ----------------------------------------------------------------------------

    def add(
        self,
        spec: WorkerSpec,
        *,
        worker_id: str | None = None,
        source: str = "static",
        meta: dict[str, str] | None = None,
    ) -> Worker:
        """Register a worker; ValueError if its URL and role (or its id) are taken.

        Without `worker_id` the fleet numbers it `<role>-<n>` (numbers are never reused)."""
        for w in self._workers.values():
            if w.url == spec.url and w.role == spec.role:
                raise ValueError(f"{spec.role} worker {spec.url} is already registered as {w.id}")
        if worker_id is None:
            self._serial[spec.role] += 1
            worker_id = f"{spec.role}-{self._serial[spec.role]}"
        elif worker_id in self._workers:
            raise ValueError(f"worker id {worker_id!r} is already registered")
        worker = Worker(
            spec=spec,
            id=worker_id,
            source=source,
            meta=dict(meta or {}),
            breaker=CircuitBreaker(self.config.breaker),
            load_fresh_secs=self.load_fresh_secs,
        )
        self._workers[worker_id] = worker
        self.policies[spec.role].add_worker(worker)
        self._bump()
        log.info("worker %s added (%s): %s %s", worker_id, source, spec.role, spec.url)
        return worker

    def remove(self, worker_id: str) -> Worker:
        """Unregister a worker: it takes no new leg; legs already running on it finish."""
        worker = self._workers.pop(worker_id)  # KeyError if unknown
        worker.removed = True
        self.policies[worker.role].remove_worker(worker)
        self._bump()
        log.info("worker %s removed (%s): %s %s", worker_id, worker.source, worker.role, worker.url)
        return worker

    def reconcile(self, source: str, desired: Iterable[WorkerRecord]) -> None:
        """Make the workers of `source` exactly `desired` (the membership Registry interface).

        Level-triggered: a record whose id is missing is added, a worker of this source absent
        from `desired` is removed, one whose spec changed is replaced (fresh breaker and health:
        it may be another engine now). Other sources' workers are never touched; a record that
        collides with another source's worker (same URL and role, or same id) is skipped with a
        warning, so the first source to name a worker owns it.
        """
        wanted = {record.id: record for record in desired}
        for worker in [w for w in self._workers.values() if w.source == source]:
            record = wanted.get(worker.id)
            if record is None or record.spec != worker.spec:
                self.remove(worker.id)
            elif record.meta != worker.meta:
                worker.meta = dict(record.meta)
        for record in wanted.values():
            if record.id in self._workers:
                if self._workers[record.id].source != source:
                    log.warning("%s: worker id %s is taken by another source", source, record.id)
                continue
            try:
                self.add(record.spec, worker_id=record.id, source=source, meta=dict(record.meta))
            except ValueError as exc:
                log.warning("%s: worker %s not added: %s", source, record.id, exc)

    def source_status(self, source: str, ok: bool, detail: str = "") -> None:
        """A membership source says whether it can be reached (readiness and metrics show it)."""
        before = self.sources.get(source)
        self.sources[source] = (ok, detail)
        if before is None or before[0] != ok:
            (log.info if ok else log.warning)(
                "membership source %s is %s%s", source, "ok" if ok else "unreachable",
                f": {detail}" if detail else "",
            )  # fmt: skip

    async def wait_changed(self, seen_version: int) -> int:
        """Wait until membership differs from `seen_version`; return the current version."""
        while self.version == seen_version:
            await self._changed.wait()
        return self.version

    # -- lookup --------------------------------------------------------------------------------

    def get(self, worker_id: str) -> Worker:
        return self._workers[worker_id]

    def workers(self, role: Role | None = None) -> list[Worker]:
        if role is None:
            return list(self._workers.values())
        return [w for w in self._workers.values() if w.role == role]

    def available(self, role: Role, model: str | None = None) -> list[Worker]:
        """Workers of `role` (serving `model`) that take traffic: healthy, registered, breaker
        allowing."""
        return [
            w
            for w in self._workers.values()
            if w.role == role and w.available() and (model is None or w.model == model)
        ]

    def routable(self, role: Role, model: str | None = None) -> list[Worker]:
        """Workers of `role` a request can go to at all: healthy and registered (breakers aside,
        see `select`). Readiness is this list being non-empty for both roles."""
        return [
            w
            for w in self._workers.values()
            if w.role == role
            and w.healthy
            and not w.removed
            and (model is None or w.model == model)
        ]

    def unpaired_engines(self) -> bool:
        """Both roles have routable workers, yet no prefill and decode of the same engine: every
        request would find no pair (`select_pair` never mixes engines)."""
        prefill = {w.spec.engine for w in self.routable("prefill")}
        decode = {w.spec.engine for w in self.routable("decode")}
        return bool(prefill and decode) and not prefill & decode

    def incompatible_backends(self) -> bool:
        """Both roles have routable workers of a shared engine, yet every such prefill and
        decode report different KV transfer backends: no request can find a pair."""
        prefills, decodes = self.routable("prefill"), self.routable("decode")
        shared = {w.spec.engine for w in prefills} & {w.spec.engine for w in decodes}
        if not shared:
            return False
        return not any(
            p.spec.engine == d.spec.engine and pairable(p, d) for p in prefills for d in decodes
        )

    # -- selection -----------------------------------------------------------------------------

    def select(
        self,
        role: Role,
        hints: RouteHints = NO_HINTS,
        avoid: frozenset[Worker] = frozenset(),
        engine: str | None = None,
        fits: Callable[[Worker], bool] | None = None,
        admit: Callable[[Worker], bool] | None = None,
    ) -> Worker:
        """Choose a worker of `role` (serving `hints.model`, when given) for a leg.

        Candidates are the healthy workers whose breaker allows traffic, preferably not in
        `avoid`. When every healthy worker's breaker is open, they are all candidates anyway
        (panic routing, as Envoy does below its panic threshold): a breaker must never take the
        last workers of a role out of rotation, or a handful of poisonous requests would turn
        into an outage for everyone. A worker that is really dead fails its health checks and
        leaves rotation that way. Policies only ever see the model's own workers, so cache-aware
        trees and loads never mix models. Workers over the overload thresholds are left out
        while another candidate is under them (`fleet/overload.py`; may raise Overloaded).
        """
        model = hints.model
        candidates = self.available(role, model)
        if engine is not None:
            candidates = [w for w in candidates if w.spec.engine == engine]
        if fits is not None:
            candidates = [w for w in candidates if fits(w)]
        if not candidates:
            candidates = self.routable(role, model)
            if engine is not None:
                candidates = [w for w in candidates if w.spec.engine == engine]
            unfitted = candidates
            if fits is not None:
                candidates = [w for w in candidates if fits(w)]
            if not candidates:
                if unfitted:
                    raise NoWorkerAvailable(
                        role, NO_COMPATIBLE_PAIR,
                        f"no {role} worker with a KV transfer backend its pair shares",
                    )  # fmt: skip
                if engine is not None and self.routable(role, model):
                    raise NoWorkerAvailable(
                        role, "no_engine_match", f"no available {engine} {role} worker"
                    )
                raise self._why_none(role, model)
            self.panics[role] += 1
            if self.on_panic is not None:
                self.on_panic(role)
        if admit is not None:  # the prefill gate: only workers with a free slot (`fleet/gates.py`)
            candidates = [w for w in candidates if admit(w)]
            if not candidates:
                raise AtCapacity(role)
        candidates = self._veto_overloaded(role, candidates)
        if avoid:
            preferred = [w for w in candidates if w not in avoid]
            if preferred:
                candidates = preferred
        return self.policies[role].choose(candidates, hints)

    def select_pair(
        self,
        hints: RouteHints = NO_HINTS,
        avoid: frozenset[Worker] = frozenset(),
        admit: Callable[[Worker], bool] | None = None,
    ) -> tuple[Worker, Worker]:
        """(prefill, decode). Raises NoWorkerAvailable for the first role with nobody up. The
        decode speaks the prefill's engine's protocol: a pair never mixes engines. Nor KV
        transfer backends (`pairable`): a prefill is a candidate only with a routable decode it
        can pair with, the decode only if it pairs with the chosen prefill; none left is
        `no_compatible_pd_pair` (SMG 1.13's lenient pairing). `admit`: which prefills have a
        free slot (the prefill gate; AtCapacity when none has)."""
        backends: dict[str, set[str | None]] = {}  # engine -> its decodes' backends
        for d in self.routable("decode", hints.model):
            backends.setdefault(d.spec.engine, set()).add(d.server_info.transfer_backend)

        def has_partner(prefill: Worker) -> bool:
            found = backends.get(prefill.spec.engine)
            # No decode of its engine at all: the decode's selection says so (no_engine_match).
            if not found:
                return True
            backend = prefill.server_info.transfer_backend
            return backend is None or None in found or backend in found

        prefill = self.select("prefill", hints, avoid, fits=has_partner, admit=admit)
        decode = self.select(
            "decode", hints, avoid, engine=prefill.spec.engine,
            fits=lambda d: pairable(prefill, d),
        )  # fmt: skip
        return prefill, decode

    def models(self) -> list[str]:
        """The models this router can serve: those a prefill AND a decode worker serve (as
        configured or reported), sorted. Asked on every request: cached until membership or a
        worker's reported model changes."""
        if self._models is None or self._models[0] != self.version:
            by_role = {role: {w.model for w in self.workers(role) if w.model} for role in ROLES}
            self._models = (self.version, sorted(by_role["prefill"] & by_role["decode"]))
            self._warn_shadowed(self._models[1])
        return self._models[1]

    def _warn_shadowed(self, models: list[str]) -> None:
        """A `--model-alias` named as a model a worker now serves: the served model wins (the
        alias would take its requests over, issue 26 N12); said once per alias."""
        for alias, canonical in self.config.model_aliases:
            if alias in models and alias not in self._shadowed:
                self._shadowed.add(alias)
                log.error(
                    "--model-alias %s=%s: a worker serves a model named %r; requests naming it "
                    "go to that model, not to %r",
                    alias,
                    canonical,
                    alias,
                    canonical,
                )

    def models_changed(self) -> None:
        self._models = None

    def track(self, worker: Worker, hold: Hold | None = None, key: str | None = None) -> Tracked:
        """`with fleet.track(worker, hold, key)`: count a leg on `worker` (under its routing
        `key`, if any); release its rank hold."""
        return Tracked(worker, hold, key)

    def record(self, worker: Worker, ok: bool) -> None:
        breaker = worker.breaker
        before = breaker.state
        if ok:
            breaker.record_success()
        else:
            breaker.record_failure()
        after = breaker.state
        if after != before:
            log.warning(
                "worker %s (%s) circuit breaker %s -> %s", worker.id, worker.url, before, after
            )

    def reject_load(self, worker: Worker, reason: str, detail: str) -> None:
        """`worker`'s engine reported a load that cannot be true: its load is unknown until a
        believable report, the refusal is counted, and logged once per run of refusals."""
        if worker.reject_load(reason) and not worker.removed:
            log.warning(
                "worker %s (%s): load report refused, its load is unknown until one that could "
                "be true (%s)",
                worker.id,
                worker.url,
                detail,
            )
        if self.on_load_rejected is not None:
            self.on_load_rejected(worker, reason)

    def evict(self) -> bool:
        """Periodic eviction for every policy; `run_eviction(fleet, secs)` drives it. True when
        a policy has more to drop (it works in batches)."""
        more = False
        for policy in self.policies.values():
            more = bool(policy.evict()) or more
        return more

    def to_json(self) -> list[dict[str, object]]:
        return [w.to_json() for w in self._workers.values()]

    def kv_policy(self) -> KvAwarePolicy | None:
        """The prefill policy when it is kv_aware (under the sticky override too), else None."""
        policy = self.policies["prefill"]
        policy = getattr(policy, "inner", policy)
        return policy if policy.name == "kv_aware" else None  # type: ignore[return-value]

    def kv_states(self) -> dict[str, str]:
        """kv_aware: each prefill worker's KV-event state (`fleet/kv_feeds.py`); {} otherwise."""
        kv = self.kv_policy()
        if kv is None:
            return {}
        states = {}
        for worker in self.workers("prefill"):
            found = kv.feeds.get(worker)
            states[worker.id] = found.state() if found is not None else "no_publisher"
        return states

    # -- internals -----------------------------------------------------------------------------

    def _veto_overloaded(self, role: Role, candidates: list[Worker]) -> list[Worker]:
        """Leave out the workers over the overload thresholds (`fleet/overload.py`)."""
        try:
            kept, vetoed, fell_back = veto(role, candidates, self.config.overload)
        except Overloaded:
            if self.on_overload is not None:
                self.on_overload(role, "shed")
            raise
        if vetoed and self.on_overload is not None:
            self.on_overload(role, "fallback" if fell_back else "vetoed")
        return kept

    def _bump(self) -> None:
        self.version += 1
        changed, self._changed = self._changed, trio.Event()
        changed.set()

    def _why_none(self, role: Role, model: str | None = None) -> NoWorkerAvailable:
        registered = [w for w in self.workers(role) if model is None or w.model == model]
        if not registered:
            serving = f" for model {model!r}" if model is not None else ""
            return NoWorkerAvailable(
                role, "none_registered", f"no {role} worker{serving} is registered"
            )
        detail = f"all {len(registered)} are unhealthy"
        timed_out = sum(1 for w in registered if w.startup_timed_out)
        if timed_out:
            detail += f" ({timed_out} never came up: --worker-startup-timeout-secs)"
        # Why they failed is in the log, the metrics and GET /workers, not in a client's answer:
        # a health error names internal addresses.
        return NoWorkerAvailable(role, "all_unhealthy", f"no available {role} worker: {detail}")
