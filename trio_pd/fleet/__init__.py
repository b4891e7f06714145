"""Worker fleet: registry, selection policies, circuit breakers, health checks, retry timing.

Pure logic plus trio timing (`trio.current_time()` only); nothing here knows HTTP.
"""

from trio_pd.fleet.breaker import CircuitBreaker
from trio_pd.fleet.health import Probe, run_health_checks
from trio_pd.fleet.policies import (
    CacheAwarePolicy,
    Policy,
    PowerOfTwoPolicy,
    RandomPolicy,
    RoundRobinPolicy,
    make_policy,
    run_eviction,
)
from trio_pd.fleet.retry import RETRYABLE_STATUSES, attempts, backoff_delay
from trio_pd.fleet.workers import Fleet, NoWorkerAvailable, Worker

__all__ = [
    "RETRYABLE_STATUSES",
    "CacheAwarePolicy",
    "CircuitBreaker",
    "Fleet",
    "NoWorkerAvailable",
    "Policy",
    "PowerOfTwoPolicy",
    "Probe",
    "RandomPolicy",
    "RoundRobinPolicy",
    "Worker",
    "attempts",
    "backoff_delay",
    "make_policy",
    "run_eviction",
    "run_health_checks",
]
