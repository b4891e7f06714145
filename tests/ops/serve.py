"""Real `trio-pd serve` processes for the operations tests: start, wait until ready, signal."""

from __future__ import annotations

import contextlib
import fcntl
import os
import resource
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import attrs
import httpx2
import trio

from trio_pd_testing.engine import EngineHandle
from trio_pd_testing.ports import free_port

# Hang guards, not bounds: readiness is waited for as an event (`/readiness` answering 200,
# every process of --workers N reached), and these only end a wait that will never finish. A
# cold start takes 2-5 s idle, up to 30 s and more on a loaded 2-core box (spawned workers
# import everything); tests/deadline.py's per-test deadline (240 s) is far above.
PROCESSES_SECS = 120.0

READY_SECS = 120.0


@contextlib.contextmanager
def taking_turns_for(port: int) -> Iterator[int]:
    """A fixed port (SGLang's default bootstrap port, which a published command line implies)
    taken in turn by every test process on this machine, the suite's xdist workers and other
    checkouts' suites alike: an exclusive lock on a file named by the port, held by the test
    until it ends. Two tests that both bind 8998 failed `make test` once, side by side."""
    with open(Path(tempfile.gettempdir()) / f"trio_pd-tests-port-{port}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a sync fixture: waits before the test's trio run
        yield port


@attrs.define
class ServeProcess:
    process: trio.Process
    port: int
    log_path: str
    metrics_port: int | None = None  # its --prometheus-port
    admin_port: int | None = None  # its --admin-port (None: `--admin-port none`)

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}"

    @property
    def admin_url(self) -> str:
        """The admin listener: without keys, where changes are served."""
        return f"http://127.0.0.1:{self.admin_port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    async def wait_ready(self, client: httpx2.AsyncClient | None = None) -> None:
        async with httpx2.AsyncClient(base_url=self.url) as own:
            probe = client or own
            with trio.fail_after(READY_SECS):
                while True:
                    if self.process.returncode is not None:
                        raise AssertionError(f"serve exited early:\n{self.log()}")
                    try:
                        if (await probe.get("/readiness")).status_code == 200:
                            return
                    except httpx2.TransportError:
                        pass
                    await trio.sleep(0.1)

    def signal(self, signum: int) -> None:
        self.process.send_signal(signum)

    async def wait_exit(self, within: float = 30.0) -> int:
        with trio.fail_after(within):
            return await self.process.wait()

    async def stop(self) -> None:
        """SIGKILL the whole process group (the router and the workers it spawned: every
        child the suite starts leads its own group, tests/processes.py)."""
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            await self.process.wait()


def admin_flags(extra: Sequence[str]) -> tuple[list[str], int | None]:
    """`--admin-port` on a free loopback port unless `extra` names it: the router's default,
    29001, would be fought over by serve processes running side by side."""
    if "--admin-port" in extra:
        given = extra[list(extra).index("--admin-port") + 1]
        return [], None if given == "none" else int(given)
    port = free_port()
    return ["--admin-port", str(port)], port


def metrics_flags(extra: Sequence[str], host: str | None = "127.0.0.1") -> tuple[list[str], int]:
    """`--prometheus-port` (and `--prometheus-host`) unless `extra` has them: the router's
    default is SMG's 0.0.0.0:29000, which serve processes running side by side (and anything
    else on the machine) would fight over. The suite never binds 29000."""
    flags: list[str] = []
    if "--prometheus-port" in extra:
        port = int(extra[list(extra).index("--prometheus-port") + 1])
    else:
        port = free_port()
        flags += ["--prometheus-port", str(port)]
    if host is not None and "--prometheus-host" not in extra:
        flags += ["--prometheus-host", host]
    return flags, port


async def start_serve(
    prefills: Sequence[EngineHandle],
    decodes: Sequence[EngineHandle],
    log_path: str,
    *extra: str,
    port: int | None = None,
    prometheus_host: str | None = "127.0.0.1",
    host: str = "127.0.0.1",
    nofile: int | tuple[int, int] | None = None,
) -> ServeProcess:
    """`python -m trio_pd serve` in front of running engines; its output goes to `log_path`.
    Its metrics listener gets a free port on `prometheus_host` (None: the router's default
    address), and its admin listener one on 127.0.0.1, unless `extra` names them. `nofile`:
    its RLIMIT_NOFILE, soft and hard alike (it cannot raise it), or (soft, hard)."""
    port = port or free_port()
    command = [sys.executable, "-m", "trio_pd", "serve", "--host", host, "--port", str(port)]
    for engine in prefills:
        command += ["--prefill", engine.url, str(engine.bootstrap_port)]
    for engine in decodes:
        command += ["--decode", engine.url]
    metrics, metrics_port = metrics_flags(extra, prometheus_host)
    admin, admin_port = admin_flags(extra)
    command += ["--log-level", "info", *metrics, *admin, *extra]
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local file, opened once
        process = await trio.lowlevel.open_process(
            command, stdout=log, stderr=subprocess.STDOUT, preexec_fn=fd_limit(nofile)
        )
    return ServeProcess(process, port, log_path, metrics_port, admin_port)


def fd_limit(nofile: int | tuple[int, int] | None) -> Callable[[], None] | None:
    """A preexec function setting the child process's RLIMIT_NOFILE (`nofile`: both limits,
    or (soft, hard))."""
    if nofile is None:
        return None
    limits = nofile if isinstance(nofile, tuple) else (nofile, nofile)

    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, limits)

    return apply


async def clients_per_process(
    router: ServeProcess, want: int = 2, url: str | None = None
) -> dict[int, httpx2.AsyncClient]:
    """One keep-alive client per router process: new connections until each was seen. `url`:
    another of its listeners shared by the processes (the admin listener), else the data plane."""
    found: dict[int, httpx2.AsyncClient] = {}
    with trio.fail_after(PROCESSES_SECS):
        while len(found) < want:
            client = httpx2.AsyncClient(base_url=url or router.url, timeout=PROCESSES_SECS)
            pid = (await client.get("/liveness")).json()["pid"]
            if pid in found:
                await client.aclose()
            else:
                found[pid] = client
    return found
