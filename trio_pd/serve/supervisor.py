"""`trio-pd serve --workers N`: one parent, N router processes that behave as one router.

The parent owns what must be one for all:
- the listening sockets: one per process on the same port with SO_REUSEPORT, so the kernel
  spreads connections evenly (a shared accept queue lets the quickest process take most);
- membership: the command line's workers go into a JSON file in a private run directory that
  every process reads and writes (`membership/shared_file.py`), so a `POST /workers` through any
  process is seen by all within a second and ids agree; with etcd there is no file: every
  process watches etcd itself, as replicas do (`membership/setup.py`);
- the admin listener's sockets (`--admin-port`) and the probe listener's
  (`--health-check-port`), made the same way: one copy per process, each
  served by its process until it exits (drain included), changes landing in the shared file;
- metrics: `PROMETHEUS_MULTIPROC_DIR` in the run directory, so `/metrics` on any process reports
  the sum over all of them (prometheus-client's multiprocess mode); the `--prometheus-port`
  listener is the parent's own (`MetricsThread`), up from before the first
  child starts until the last one ended, restarts included;
- the processes themselves: a child that dies is restarted with a doubling backoff, logged and
  counted (`trio_pd_process_restarts_total`); signals are handled from before the first child
  starts. SIGTERM or SIGINT closes the parent's copies of the sockets and forwards SIGTERM to
  every child, which drains (`drain.py`); a second signal is forwarded too and ends the grace.
What stays per process (as Envoy keeps it per host): health checks, breakers, loads, the
connection pool, and admission: `--max-concurrent-requests`, `--queue-size` and
`--rate-limit-tokens-per-second` are divided among the processes (`process_config`), so the
totals hold exactly.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from functools import partial
from multiprocessing.connection import wait as wait_for_any
from pathlib import Path
from typing import Any

import attrs
import trio
from hypercorn.config import Sockets

from trio_pd.config import RouterConfig
from trio_pd.observe.metrics import render_multiprocess
from trio_pd.serve.doors import (
    Door,
    DoorName,
    HttpOnly,
    ListenError,
    bind_door,
    data_door,
    metrics_page,
    serve_door,
    side_doors,
)
from trio_pd.serve.listeners import SIDE_GRACE_SECS, close_sockets

log = logging.getLogger(__name__)
RESTART_BACKOFF_SECS = (0.5, 30.0)  # first delay, cap (doubling; reset after a minute of life)
POLL_SECS = 0.2
THREAD_START_SECS = 10.0


def per_process(config: RouterConfig, workers: int, run_dir: Path) -> RouterConfig:
    """The config every router process shares (admission is split by `process_config`)."""
    shared = config.membership_file or str(run_dir / "membership.json")
    return attrs.evolve(
        config,
        workers=1,
        membership_file=None if config.etcd is not None else shared,
        prometheus_port=None,  # the parent serves it
        other_listeners=own_metrics_listener(config),
    )


def own_metrics_listener(config: RouterConfig) -> tuple[tuple[str, int], ...]:
    """The parent's metrics listener, which no child binds but no worker URL may point at."""
    port = config.prometheus_port
    return ((config.prometheus_host, port),) if port else ()


def share(total: int, index: int, workers: int) -> int:
    """Process `index`'s part of `total`: the parts differ by one at most and add up to it."""
    return total // workers + (1 if index < total % workers else 0)


def process_config(child: RouterConfig, config: RouterConfig, index: int) -> RouterConfig:
    """Process `index`'s admission: its share of the cap, the line and the rate, so that the
    sums over the processes are what the flags say (`cli` refuses a cap below the process
    count: a process with no slot would refuse every request the kernel hands it)."""
    workers = config.workers
    limit = config.max_concurrent_requests
    rate = config.rate_limit_tokens_per_second
    child = attrs.evolve(child, max_buffered_bytes=share(config.max_buffered_bytes, index, workers))
    if limit <= 0:
        return attrs.evolve(child, queue_size=share(config.queue_size, index, workers))
    mine = share(limit, index, workers)
    return attrs.evolve(
        child,
        max_concurrent_requests=mine,
        rate_limit_tokens_per_second=rate * mine / limit if rate else rate,
        queue_size=share(config.queue_size, index, workers),
    )


@attrs.define
class Slot:
    """One child process position: its sockets, its process, its restart backoff."""

    index: int
    listening: dict[DoorName, Sockets]  # its copy of each door's sockets (SO_REUSEPORT)
    process: multiprocessing.process.BaseProcess | None = None
    ready: Any = None  # a multiprocessing Event the child sets once it handles SIGTERM
    told: int = 0  # SIGTERMs forwarded to the current process
    started_at: float = 0.0
    delay: float = RESTART_BACKOFF_SECS[0]
    restart_at: float | None = None


class Supervisor:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.run_dir = Path(tempfile.mkdtemp(prefix="trio-pd-"))
        self.child_config = per_process(config, config.workers, self.run_dir)
        self.context = multiprocessing.get_context("spawn")
        self.stopping = False
        self.signals = 0
        self.slots: list[Slot] = []
        self.restarts = None
        self.port = config.port
        self.sockets_closed = False
        self.metrics_listener: MetricsThread | None = None

    def run(self) -> int:
        """Start the children and watch them until they all ended after a signal."""
        signal.signal(signal.SIGTERM, self._on_signal)  # before any child exists
        signal.signal(signal.SIGINT, self._on_signal)
        log.info("starting %d router processes", self.config.workers)
        try:
            self._prepare()
            for slot in self.slots:
                if not self.stopping:
                    self._start(slot)
            log.info(
                "trio-pd routing on %s:%d with %d processes (run dir %s)",
                self.config.host, self.port, self.config.workers, self.run_dir,
            )  # fmt: skip
            return self._watch()
        finally:
            self._close_sockets()
            if self.metrics_listener is not None:
                self.metrics_listener.stop()
            shutil.rmtree(self.run_dir, ignore_errors=True)

    # -- set-up -----------------------------------------------------------------------------

    def _prepare(self) -> None:
        from trio_pd.membership.shared_file import seed

        metrics_dir = self.run_dir / "metrics"
        metrics_dir.mkdir()
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)  # inherited by the children
        self.restarts = parent_restart_counter()
        config = self.config
        # Every door is bound before any process exists (metrics first, as SMG: a port taken
        # fails the start); the metrics door is the parent's, the others one copy a process.
        workers = config.workers
        doors = {door.name: door for door in (*side_doors(config), data_door(config))}
        copies: dict[DoorName, list[Sockets]] = {}
        try:
            for name, door in doors.items():
                copies[name] = bind_door(door, config, 1 if name == "metrics" else workers)
        except ListenError:
            for made in copies.values():
                for sockets in made:
                    close_sockets(sockets)
            raise
        metrics = copies.pop("metrics", None)
        if metrics is not None:
            render = partial(render_multiprocess, str(metrics_dir))
            self.metrics_listener = MetricsThread(doors["metrics"], render, metrics[0])
            self.metrics_listener.start()
        first = copies["data"][0]
        self.port = (*first.secure_sockets, *first.insecure_sockets)[0].getsockname()[1]
        # With etcd every process watches it and the flags' workers stay "static": no file.
        shared = self.child_config.membership_file
        if shared and (self.config.membership_file is None or not Path(shared).exists()):
            seed(Path(shared), (*self.config.prefill, *self.config.decode))
        for index in range(workers):
            self.slots.append(Slot(index, {name: made[index] for name, made in copies.items()}))

    def _start(self, slot: Slot) -> None:
        from trio_pd.serve.process import worker_main

        slot.ready = self.context.Event()
        slot.told = 0
        process = self.context.Process(
            target=worker_main,
            args=(
                process_config(self.child_config, self.config, slot.index),
                slot.listening,
                slot.index,
                slot.ready,
            ),
            name=f"trio-pd-{slot.index}",
        )
        process.start()
        slot.process = process
        slot.started_at = time.monotonic()
        slot.restart_at = None

    # -- watching ---------------------------------------------------------------------------

    def _watch(self) -> int:
        failed = False
        while True:
            if self.stopping:
                self._close_sockets()  # new connections are refused from now on
                self._forward_signals()
            live = [s for s in self.slots if s.process is not None and s.process.is_alive()]
            if self.stopping and not live:
                break
            sentinels = [s.process.sentinel for s in live]  # type: ignore[union-attr]
            wait_for_any(sentinels, timeout=POLL_SECS)
            now = time.monotonic()
            for slot in self.slots:
                process = slot.process
                if process is None:
                    due = slot.restart_at is not None and now >= slot.restart_at
                    if due and not self.stopping:
                        self._start(slot)
                    continue
                if process.is_alive():
                    continue
                code = process.exitcode
                process.join()
                slot.process = None
                self._forget_gauges(process.pid)
                if self.stopping:
                    # -SIGTERM: our signal reached a child still starting, before its handler.
                    failed = failed or code not in (0, None, -signal.SIGTERM)
                    continue
                self._schedule_restart(slot, code, now)
        return 1 if failed else 0

    def _forget_gauges(self, pid: int | None) -> None:
        """A dead process's live gauges (legs in flight, active connections) stop counting in
        the sum; its counters and histograms stay, as what it did still happened."""
        from prometheus_client import multiprocess

        if pid is not None:
            multiprocess.mark_process_dead(pid, str(self.run_dir / "metrics"))

    def _schedule_restart(self, slot: Slot, code: int | None, now: float) -> None:
        if now - slot.started_at > 60:
            slot.delay = RESTART_BACKOFF_SECS[0]
        log.error(
            "router process %d exited with %s; restarting it in %.1fs",
            slot.index, code, slot.delay,
        )  # fmt: skip
        if self.restarts is not None:
            self.restarts.inc()
        slot.restart_at = now + slot.delay
        slot.delay = min(RESTART_BACKOFF_SECS[1], slot.delay * 2)

    def _on_signal(self, signum: int, frame: object) -> None:
        """Note the signal; the watch loop does the rest. This handler may run while a child
        is being started, so it touches neither the sockets nor the children."""
        self.signals += 1
        if not self.stopping:
            self.stopping = True
            log.info("%s: draining the router processes", signal.Signals(signum).name)

    def _forward_signals(self) -> None:
        """SIGTERM to each child (a second one for a second signal: it ends the grace), but
        only once the child handles it: a signal that reaches a child still starting up is
        lost (or kills it without a drain)."""
        for slot in self.slots:
            process = slot.process
            if process is None or not process.is_alive() or not slot.ready.is_set():
                continue
            while slot.told < min(self.signals, 2):
                slot.told += 1
                process.terminate()

    def _close_sockets(self) -> None:
        if self.sockets_closed:
            return
        self.sockets_closed = True
        for slot in self.slots:  # each process holds its own copies until it exits
            for sockets in slot.listening.values():
                close_sockets(sockets)


def parent_restart_counter() -> Any:
    """The parent's own metric, written to the shared multiprocess directory.

    prometheus-client picks its value storage when first imported, from the environment; the
    parent imported it before the directory existed, so its storage is switched here."""
    from prometheus_client import CollectorRegistry, Counter, values

    values.ValueClass = values.MultiProcessValue()
    return Counter(
        "trio_pd_process_restarts",
        "Router processes restarted after they died (--workers N).",
        registry=CollectorRegistry(),
    )


class MetricsThread:
    """The supervisor's metrics door (`--workers N`): its own trio run in a daemon thread.

    The parent's main thread waits on its children with `multiprocessing`, not trio; a thread
    keeps the listener independent of it. `render` must be thread-safe (the parent's renders
    the multiprocess files, which the children write)."""

    def __init__(self, door: Door, render: Callable[[], bytes], sockets: Sockets) -> None:
        self.door = door
        self.render = render
        self.sockets = sockets
        self.urls: list[str] = []
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._up = threading.Event()
        self._thread = threading.Thread(target=self._main, name="trio-pd-metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()
        if not self._up.wait(THREAD_START_SECS):
            raise ListenError("the metrics listener did not start")

    def stop(self) -> None:
        token, stop = self._token, self._stop
        if token is not None and stop is not None:
            with contextlib.suppress(trio.RunFinishedError):
                trio.from_thread.run_sync(stop.set, trio_token=token)
        self._thread.join(SIDE_GRACE_SECS + 5)

    def _main(self) -> None:
        try:
            trio.run(self._serve)
        except Exception:
            log.exception("the metrics listener failed")
        finally:
            self._up.set()  # (also when it failed before it was up: start() must not hang)
            close_sockets(self.sockets)

    async def _serve(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        app = HttpOnly(metrics_page(self.render))
        async with trio.open_nursery() as nursery:
            self.urls = await nursery.start(
                partial(serve_door, self.door, app, self.sockets, self._stop.wait)
            )
            self._up.set()
