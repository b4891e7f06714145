"""`--prometheus-port` / `--prometheus-host` / `--prometheus-duration-buckets` on real `trio-pd
serve` processes: metrics only, where asked, and with `--workers 2` served by the supervisor
with the sum over the processes (a taken port and the drain: tests/ops/test_doors.py). Every
router here gets a free port from the helper: the suite never binds 29000."""

from __future__ import annotations

import contextlib
import os
import re
import signal
from pathlib import Path

import httpx2
import trio

from tests.conftest import start_engine
from tests.ops.serve import ServeProcess, clients_per_process, start_serve
from tests.ops.sockets import holders, listeners
from tests.router.helpers import generate_body
from trio_pd.cli.main import build_parser, router_config

LOOSE = 10.0


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of a Prometheus text page (None when absent)."""
    for line in text.splitlines():
        if not line.startswith(name + ("{" if labels else " ")):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return None


async def scrape(router: ServeProcess) -> httpx2.Response:
    async with httpx2.AsyncClient(base_url=router.metrics_url, timeout=LOOSE) as scraper:
        return await scraper.get("/metrics")


def test_defaults_are_smgs() -> None:
    config = router_config(build_parser().parse_args(["serve"]))
    assert (config.prometheus_host, config.prometheus_port) == ("0.0.0.0", 29000)
    assert config.prometheus_duration_buckets is None


async def test_metrics_only_on_the_address_asked(nursery: trio.Nursery, tmp_path: Path) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "router.log"),
        "--prometheus-duration-buckets", "7", "0.5",
    )  # fmt: skip
    try:
        await router.wait_ready()
        assert router.metrics_port is not None
        # Bound where the helper asked (127.0.0.1), and nowhere else.
        assert list(listeners(router.metrics_port)) == ["127.0.0.1"]
        async with httpx2.AsyncClient(base_url=router.url) as client:
            answer = await client.post("/generate", json=generate_body(stream=True))
            assert answer.status_code == 200 and answer.text.endswith("data: [DONE]\n\n")
        async with httpx2.AsyncClient(base_url=router.metrics_url) as scraper:
            # The request is counted as the router's side of it ends, which can be just after
            # the client read its answer: scraped until it shows (or 10 s).
            with trio.move_on_after(10):
                while True:
                    metrics = await scraper.get("/metrics")
                    text = metrics.text
                    if sample(text, "trio_pd_requests_total", path="/generate") is not None:
                        break
                    await trio.sleep(0.02)
            assert metrics.status_code == 200
            assert metrics.headers["content-type"].startswith("text/plain")
            assert sample(text, "trio_pd_requests_total", path="/generate", status="200") == 1
            # The duration buckets asked for, on the *_duration_seconds histogram only.
            buckets = "trio_pd_request_duration_seconds_bucket"
            assert sample(text, buckets, path="/generate", le="7.0") == 1
            assert sample(text, buckets, path="/generate", le="0.5") is not None
            assert sample(text, buckets, path="/generate", le="300.0") is None
            # Other histograms keep their own scales (time to first token: from 5 ms).
            first_token = "trio_pd_time_to_first_token_seconds_bucket"
            assert sample(text, first_token, le="0.005") is not None
            assert sample(text, first_token, le="7.0") is None
            for method, path in [("GET", "/workers"), ("POST", "/generate"), ("GET", "/health"),
                                 ("POST", "/flush_cache"), ("GET", "/")]:  # fmt: skip
                response = await scraper.request(method, path, json={})
                assert response.status_code == 404, path
                assert response.json()["error"]["type"] == "not_found_error"
            refused = await scraper.post("/metrics")
            assert refused.status_code == 405 and refused.headers["allow"] == "GET"
        assert len(prefill.events.find("request_start")) == 1  # the metrics port reached none
        async with httpx2.AsyncClient(base_url=router.url) as client:
            main = await client.get("/metrics")  # the main port keeps its /metrics
            assert main.status_code == 200 and "trio_pd_requests_total" in main.text
        router.signal(signal.SIGTERM)
        assert await router.wait_exit() == 0
    finally:
        await router.stop()
    assert "metrics on http://127.0.0.1:" in router.log()


async def test_default_address_is_every_interface(nursery: trio.Nursery, tmp_path: Path) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    # No --prometheus-host: the router's default (SMG's 0.0.0.0), on a free port.
    router = await start_serve([prefill], [decode], str(tmp_path / "r.log"), prometheus_host=None)
    try:
        await router.wait_ready()
        assert router.metrics_port is not None
        assert list(listeners(router.metrics_port)) == ["0.0.0.0"]
        assert list(listeners(router.port)) == ["127.0.0.1"]  # --host is another matter
        assert (await scrape(router)).status_code == 200
    finally:
        await router.stop()


async def test_the_supervisor_serves_the_sum_over_processes(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve([prefill], [decode], str(tmp_path / "router.log"), "--workers", "2")
    clients: dict[int, httpx2.AsyncClient] = {}
    try:
        await router.wait_ready()
        clients = await clients_per_process(router)
        for client in clients.values():
            for _ in range(3):
                assert (await client.post("/generate", json=generate_body())).status_code == 200
        assert router.metrics_port is not None
        (inode,) = listeners(router.metrics_port).values()
        # The parent holds the metrics socket; the router processes do not.
        supervisor = router.process.pid
        assert holders(inode, [supervisor, *clients]) == {supervisor}
        with trio.fail_after(LOOSE):  # the router processes sync their gauges every second
            while True:
                text = (await scrape(router)).text
                total = sample(text, "trio_pd_requests_total", path="/generate", status="200")
                if total == 6 and sample(text, "trio_pd_worker_healthy", worker="decode-1"):
                    break
                await trio.sleep(0.2)
        # A router process dies: the listener is the parent's, so it keeps answering, and
        # counts the restart.
        victim = next(iter(clients))
        await clients.pop(victim).aclose()
        os.kill(victim, signal.SIGKILL)
        with trio.fail_after(LOOSE):
            while sample((await scrape(router)).text, "trio_pd_process_restarts_total") != 1:
                await trio.sleep(0.1)
        router.signal(signal.SIGTERM)
        assert await router.wait_exit() == 0
    finally:
        for client in clients.values():
            await client.aclose()
        await router.stop()
    assert not listeners(router.metrics_port)


async def test_a_killed_process_leaves_no_live_gauges_behind(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A router process killed mid-stream is restarted; the legs it had in flight must not stay
    in the supervisor's sum (its live gauge files are dropped), while its counters do."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode", inter_token_ms=100)
    router = await start_serve([prefill], [decode], str(tmp_path / "router.log"), "--workers", "2")
    clients: dict[int, httpx2.AsyncClient] = {}

    async def in_flight() -> float | None:
        text = (await scrape(router)).text
        return sample(text, "trio_pd_worker_in_flight", worker="decode-1")

    async def stream(client: httpx2.AsyncClient) -> None:
        body = generate_body(stream=True, max_new_tokens=300)
        with contextlib.suppress(httpx2.HTTPError):
            async with client.stream("POST", "/generate", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

    try:
        await router.wait_ready()
        clients = await clients_per_process(router)
        async with trio.open_nursery() as streams:
            for client in clients.values():  # one stream in each process
                streams.start_soon(stream, client)
            with trio.fail_after(LOOSE):  # the processes sync their gauges every second
                while await in_flight() != 2:
                    await trio.sleep(0.2)
            for pid in clients:
                os.kill(pid, signal.SIGKILL)
        with trio.fail_after(LOOSE):
            while sample((await scrape(router)).text, "trio_pd_process_restarts_total") != 2:
                await trio.sleep(0.1)
        await router.wait_ready()
        await trio.sleep(2.5)  # the new processes have synced their own (zero) gauges
        assert await in_flight() == 0
        assert len(decode.events.find("request_start")) == 2  # nothing else ran meanwhile
    finally:
        for client in clients.values():
            await client.aclose()
        await router.stop()
