"""The vLLM prefills' lease counters (issue 27 finding 4, `control/vllm_leases.py`): the
increases of the engine's own `vllm:nixl_num_notifications_after_expiry` and
`vllm:nixl_num_kv_expired_reqs` are counted per prefill and exported. The real engine's side is
`tests/vllm/test_router_findings.py` (a late read provoked and seen counted)."""

from __future__ import annotations

from trio_pd.control.vllm_leases import LeaseWatch, engine_counts
from trio_pd.fleet.worker import Worker
from trio_pd.observe.metrics import FleetCollector
from trio_pd.spec import WorkerSpec


def page(late: float, expired: float) -> str:
    """Lines as vLLM 0.32 writes them (one sample per engine, labelled)."""
    return (
        "# HELP vllm:nixl_num_notifications_after_expiry_total Number of ...\n"
        "# TYPE vllm:nixl_num_notifications_after_expiry_total counter\n"
        f'vllm:nixl_num_notifications_after_expiry_total{{engine="0",model_name="m"}} {late}\n'
        f'vllm:nixl_num_notifications_after_expiry_created{{engine="0",model_name="m"}} 1.7e9\n'
        f'vllm:nixl_num_kv_expired_reqs_total{{engine="0",model_name="m"}} {expired}\n'
        'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    )


class Fleet:
    def __init__(self, *workers: Worker) -> None:
        self._workers = list(workers)

    def workers(self, role=None):
        return [w for w in self._workers if role is None or w.role == role]


def vllm_prefill(name: str = "p1") -> Worker:
    return Worker(spec=WorkerSpec(f"http://{name}:8000", "prefill", engine="vllm"), id=name)


def test_engine_counts_reads_the_two_counters_only() -> None:
    counts = engine_counts(page(3, 7))
    assert counts == {
        "vllm:nixl_num_notifications_after_expiry_total": 3.0,
        "vllm:nixl_num_kv_expired_reqs_total": 7.0,
    }
    assert engine_counts("vllm:kv_cache_usage_perc 0.1\n") == {}


async def test_increases_after_the_baseline_are_counted_and_a_restart_too() -> None:
    prefill = vllm_prefill()
    sglang = Worker(spec=WorkerSpec("http://s:8000", "prefill"), id="s")
    pages = iter([page(5, 9), page(6, 11), page(6, 11), page(1, 0)])
    asked: list[str] = []

    async def fetch(worker: Worker) -> str:
        asked.append(worker.id)
        return next(pages)

    watch = LeaseWatch(Fleet(prefill, sglang), fetch, 60.0)  # type: ignore[arg-type]
    await watch.read_all()  # the baseline: what happened before the router started
    assert (prefill.vllm_reads_after_lease, prefill.vllm_leases_expired) == (0, 0)
    await watch.read_all()
    assert (prefill.vllm_reads_after_lease, prefill.vllm_leases_expired) == (1, 2)
    await watch.read_all()
    assert (prefill.vllm_reads_after_lease, prefill.vllm_leases_expired) == (1, 2)
    await watch.read_all()  # the counter went down: a restarted engine, its count is new
    assert (prefill.vllm_reads_after_lease, prefill.vllm_leases_expired) == (2, 2)
    assert asked == ["p1"] * 4  # the SGLang prefill is never asked


async def test_an_unreadable_page_counts_nothing_and_is_not_fatal() -> None:
    prefill = vllm_prefill()
    calls = 0

    async def fetch(worker: Worker) -> str:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise OSError("connection refused")
        return page(calls, 0)

    watch = LeaseWatch(Fleet(prefill), fetch, 60.0)  # type: ignore[arg-type]
    for _ in range(3):
        await watch.read_all()
    assert prefill.vllm_reads_after_lease == 2  # 1 -> 3 across the failed read


def test_the_counts_are_exported_per_vllm_prefill() -> None:
    prefill = vllm_prefill()
    prefill.vllm_reads_after_lease = 4
    collector = FleetCollector(Fleet(prefill), pool=None, queue_depth=lambda: 0)  # type: ignore[arg-type]
    families = {f.name: f for f in collector._vllm_leases()}
    (sample,) = families["trio_pd_vllm_kv_reads_after_lease"].samples
    assert sample.value == 4 and sample.labels["worker"] == "p1"
