"""Processes of a benchmark, started and reaped in one place: engines (the simulator or the
instant engine), routers (trio_pd, SMG 1.13, mini_lb) and the cluster that holds them; every
child runs in its own session with its output in a log file, and stop() ends its whole tree."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import orjson
import psutil

from bench.harness.cpu import CpuMeter, tree_procs
from bench.harness.output import BENCH, print_flush
from trio_pd_testing.ports import free_port

PEERS = BENCH / ".peers"
# SMG 1.13 as `python -m smg`, never bench/.peers/bin/smg: sglang-router 0.3.2 (mini_lb's
# package, installed beside it) ships a console script of the same name that runs its own 0.3.2
# gateway, and which of the two wins depends on pip's install order.
SMG = (str(PEERS / "bin" / "python"), "-m", "smg")
VENV_BIN = Path(sys.executable).parent
HOST = "127.0.0.1"  # the only valid load target

ROUTERS = ("trio_pd", "trio_pd_w2", "trio_pd_noabort", "trio_pd_nomigrate", "smg", "mini_lb")
# `--peers` (make bench-peers) compares against SMG 1.13 and SGLang's mini_lb; trio_pd_noabort
# (trio_pd with `--no-abort-on-cancel`) runs on request: `--routers trio_pd,trio_pd_noabort`;
# trio_pd_nomigrate (`--migration-limit 0`) is bench/rolling.py's control.
PEER_ROUTERS = ("trio_pd", "trio_pd_w2", "smg", "mini_lb")
TRIO_PD_KINDS = ("trio_pd", "trio_pd_w2", "trio_pd_noabort", "trio_pd_nomigrate")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


# ---- processes ------------------------------------------------------------------------------


def http_get(port: int, path: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return 0


def http_post(port: int, path: str, body: dict[str, Any], timeout: float = 5.0) -> int:
    req = urllib.request.Request(
        f"http://{HOST}:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            resp.read()
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (OSError, ValueError):
        return 0


class Proc:
    """A child process with its output in a log file; stop() terminates its whole tree."""

    def __init__(
        self, name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:  # fmt: skip
        self.name = name
        self.argv = argv
        self.log = logdir / f"{name}.log"
        self._out = open(self.log, "ab")  # noqa: SIM115
        self.popen = subprocess.Popen(
            argv, stdout=self._out, stderr=subprocess.STDOUT, start_new_session=True, env=env,
            cwd=cwd,
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 5.0) -> None:
        procs = tree_procs(self.pid)
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        for p in procs[1:]:  # descendants that outlived their parent (same session)
            with contextlib.suppress(psutil.Error):
                if p.is_running():
                    p.kill()
        self._out.close()

    def tail(self, lines: int = 20) -> str:
        """The last lines of the log, without terminal colour codes (SMG writes them even to a
        file, and this text ends up in exception messages on the console)."""
        try:
            text = ANSI.sub("", self.log.read_text(errors="replace"))
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def wait_until(check: Any, timeout: float, what: str, proc: Proc | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if proc is not None and not proc.alive():
            raise RuntimeError(f"{what}: process exited\n{proc.tail()}")
        time.sleep(0.05)
    raise RuntimeError(f"{what}: not ready after {timeout}s" + (f"\n{proc.tail()}" if proc else ""))


@attrs.define
class Engine:
    role: str
    port: int
    proc: Proc
    events_path: Path
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def events(self) -> list[dict[str, Any]]:
        try:
            data = self.events_path.read_bytes()
        except OSError:
            return []
        out = []
        for line in data.splitlines():
            with contextlib.suppress(orjson.JSONDecodeError):
                out.append(orjson.loads(line))
        return out


def trio_pd_bin() -> str:
    return str(VENV_BIN / "trio-pd")


def trio_pd_testing_bin() -> str:
    """The test engines' command (testing/: the simulator), installed beside the router's."""
    return str(VENV_BIN / "trio-pd-testing")


def start_instant(
    role: str, logdir: Path, args: Sequence[str] = (), name: str | None = None
) -> Engine:
    """bench/instant_engine.py (uvloop + httptools, answers at once): the router is the only
    busy program. Its `/stats` counts what it completed."""
    port = free_port()
    argv = [sys.executable, "-m", "bench.instant_engine", "--role", role, "--host", HOST,
            "--port", str(port), *args]  # fmt: skip
    bootstrap = None
    if role == "prefill":
        bootstrap = free_port()
        argv += ["--bootstrap-port", str(bootstrap)]
    proc = Proc(name or f"instant-{role}", argv, logdir)
    try:
        wait_until(lambda: http_get(port, "/health") == 200, 20, role, proc)
    except BaseException:
        proc.stop()
        raise
    return Engine(role, port, proc, logdir / f"{role}.none", bootstrap)


def start_engine(
    role: str, logdir: Path, *, port: int | None = None, bootstrap_port: int | None = None,
    args: Sequence[str] = (), name: str | None = None, wait: bool = True,
) -> Engine:  # fmt: skip
    port = port or free_port()
    events = logdir / f"{name or role}.events.jsonl"
    argv = [trio_pd_testing_bin(), "engine", "--role", role, "--host", HOST, "--port", str(port)]
    if role == "prefill":
        bootstrap_port = bootstrap_port or free_port()
        argv += ["--bootstrap-port", str(bootstrap_port)]
    argv += ["--events", str(events), "--log-level", "warning", *args]
    proc = Proc(name or role, argv, logdir)
    engine = Engine(role, port, proc, events, bootstrap_port)
    if wait and "refuse" not in " ".join(args):
        wait_until(lambda: http_get(port, "/health") == 200, 20, f"{role} engine", proc)
    return engine


def router_argv(
    kind: str, prefills: Sequence[Engine], decode: Engine, port: int, extra: Sequence[str] = ()
) -> list[str]:
    common = []
    for prefill in prefills:
        common += ["--prefill", prefill.url, str(prefill.bootstrap_port)]
    common += ["--decode", decode.url, "--host", HOST, "--port", str(port)]
    # Its metrics listener defaults to 0.0.0.0:29000, as SMG's, and a router cannot start when
    # that port is taken (e.g. by a previous router still shutting down): each gets its own.
    metrics = ["--prometheus-host", HOST, "--prometheus-port", str(free_port())]
    if kind in TRIO_PD_KINDS:
        argv = [trio_pd_bin(), "serve", *common, "--log-level", "warning", *metrics]
        argv += ["--admin-port", str(free_port())]  # not its default 29001: the same reason
        argv += ["--policy", "round_robin"]
        if kind == "trio_pd_w2":
            argv += ["--workers", "2"]
        if kind == "trio_pd_noabort":  # closing a cancelled leg is all: the engine's poll frees it
            argv += ["--no-abort-on-cancel"]
        if kind == "trio_pd_nomigrate":  # a broken decode ends the stream (bench/rolling.py)
            argv += ["--migration-limit", "0"]
        return argv + list(extra)
    python = str(PEERS / "bin" / "python")
    if kind == "smg":  # SMG 1.13 (`smg launch`); it panics at start when its metrics port is taken
        return [*SMG, "launch", "--pd-disaggregation", *common,
                "--policy", "round_robin", "--log-level", "warn", *metrics, *extra]  # fmt: skip
    if kind == "mini_lb":  # SGLang's Python mini_lb (its own PD tests still launch it so)
        return [python, "-m", "sglang_router.launch_router", "--pd-disaggregation", *common,
                "--mini-lb", "--policy", "random", *extra]  # fmt: skip
    raise ValueError(f"unknown router {kind!r}")


def peers_available() -> bool:
    return (PEERS / "bin" / "python").exists()


def usable_routers(routers: list[str]) -> list[str]:
    """`routers` checked against ROUTERS (exit on an unknown one), less SGLang's when
    bench/.peers is not installed (said so)."""
    for router in routers:
        if router not in ROUTERS:
            raise SystemExit(f"unknown router {router!r}; choose from {', '.join(ROUTERS)}")
    if any(r in ("smg", "mini_lb") for r in routers) and not peers_available():
        print_flush("bench/.peers is missing (make bench-peers installs it): skipping smg, mini_lb")
        routers = [r for r in routers if r not in ("smg", "mini_lb")]
    return routers


@attrs.define
class Cluster:
    """One prefill engine, one decode engine and (optionally) a router in front of them."""

    logdir: Path
    prefill: Engine
    decode: Engine
    router_kind: str | None = None
    router: Proc | None = None
    router_port: int = 0
    keep_logs: bool = False
    prefill2: Engine | None = None

    @property
    def target_port(self) -> int:
        return self.router_port

    def pids(self) -> dict[str, int]:
        out = {"prefill": self.prefill.proc.pid, "decode": self.decode.proc.pid}
        if self.router is not None:
            out["router"] = self.router.pid
        return out

    def engines(self) -> list[Engine]:
        return [self.prefill, self.decode] + ([self.prefill2] if self.prefill2 else [])

    def router_tree(self) -> list[psutil.Process]:
        return tree_procs(self.router.pid) if self.router else []

    def stop(self) -> None:
        extra = self.prefill2.proc if self.prefill2 else None
        for proc in (self.router, self.prefill.proc, self.decode.proc, extra):
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.stop()
        if not self.keep_logs:
            shutil.rmtree(self.logdir, ignore_errors=True)


def probe_body() -> dict[str, Any]:
    return {"text": "warm up", "sampling_params": {"max_new_tokens": 1}}


class EngineDied(RuntimeError):
    """An engine exited while the router was starting; cluster() starts everything again."""


def http_get_json(port: int, path: str, timeout: float = 2.0) -> Any:
    try:
        with urllib.request.urlopen(f"http://{HOST}:{port}{path}", timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


def smg_workers_registered(port: int, count: int) -> bool:
    """SMG answers /health before it has registered any worker (registration runs in the
    background), so the first requests fail with "No prefill workers available"."""
    data = http_get_json(port, "/workers")
    return isinstance(data, dict) and len(data.get("workers") or []) >= count


def check_engines(cluster: Cluster, what: str) -> None:
    for engine in cluster.engines():
        if not engine.proc.alive():
            raise EngineDied(f"{what}: {engine.proc.name} engine exited\n{engine.proc.tail()}")


def start_router(cluster: Cluster, kind: str, extra: Sequence[str] = ()) -> None:
    port = free_port()
    prefills = [cluster.prefill] + ([cluster.prefill2] if cluster.prefill2 else [])
    argv = router_argv(kind, prefills, cluster.decode, port, extra)
    cluster.router = Proc(f"router-{kind}", argv, cluster.logdir)
    cluster.router_kind = kind
    cluster.router_port = port
    wait_until(lambda: http_get(port, "/health") == 200, 60, f"router {kind}", cluster.router)
    if kind == "smg":
        # Registering a worker, SMG probes it over HTTP and over gRPC (HTTP/2 prior knowledge)
        # at once, so every engine also gets a few short h2 connections. The simulator's
        # hypercorn h2 code can raise BusyResourceError when such a connection closes, and that
        # ends the engine process; cluster() then starts engines and router again.
        wait_until(
            lambda: smg_workers_registered(port, len(prefills) + 1) or not all_alive(cluster),
            60,
            f"router {kind} worker registration",
            cluster.router,
        )
        time.sleep(0.5)  # the gRPC probes' connections wind down
    check_engines(cluster, f"router {kind} start")
    # a real PD request must succeed (SMG and trio_pd start with unchecked workers)
    wait_until(
        lambda: http_post(port, "/generate", probe_body()) == 200 or not all_alive(cluster),
        60,
        f"router {kind} first request",
        cluster.router,
    )
    check_engines(cluster, f"router {kind} first request")
    if kind == "trio_pd_w2":  # both worker processes must be up: a few more probes
        for _ in range(8):
            http_post(port, "/generate", probe_body())


def all_alive(cluster: Cluster) -> bool:
    return all(engine.proc.alive() for engine in cluster.engines())


START_ATTEMPTS = 5


@contextlib.contextmanager
def cluster(
    router: str | None,
    *,
    prefill_args: Sequence[str] = (),
    decode_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
    keep_logs: bool = False,
    prefill2_args: Sequence[str] | None = None,
) -> Iterator[Cluster]:
    c = None
    try:
        for attempt in range(1, START_ATTEMPTS + 1):
            c = start_cluster(router, prefill_args, decode_args, router_args, keep_logs,
                              prefill2_args)  # fmt: skip
            try:
                if router is not None:
                    start_router(c, router, router_args)
                break
            except EngineDied as exc:
                lines = str(exc).splitlines()
                print_flush(f"  start {attempt}/{START_ATTEMPTS}: {lines[0]} ({lines[-1].strip()})")
                c.stop()
                c = None
                if attempt == START_ATTEMPTS:
                    raise
        assert c is not None
        yield c
    finally:
        if c is not None:
            c.stop()


def start_cluster(
    router: str | None,
    prefill_args: Sequence[str],
    decode_args: Sequence[str],
    router_args: Sequence[str],
    keep_logs: bool,
    prefill2_args: Sequence[str] | None,
) -> Cluster:
    """Engines only (a fresh log directory, so a failed start leaves nothing in the event logs
    of the next one)."""
    logdir = Path(tempfile.mkdtemp(prefix="trio-pd-bench-"))
    c = None
    prefill = decode = None
    try:
        prefill = start_engine("prefill", logdir, args=prefill_args)
        decode = start_engine("decode", logdir, args=decode_args)
        c = Cluster(logdir, prefill, decode, keep_logs=keep_logs)
        if prefill2_args is not None:
            c.prefill2 = start_engine("prefill", logdir, args=prefill2_args, name="prefill2")
        return c
    except BaseException:
        if c is not None:
            c.stop()
        else:
            for engine in (prefill, decode):
                if engine is not None:
                    engine.proc.stop()
            shutil.rmtree(logdir, ignore_errors=True)
        raise


def failure_router_args(kind: str) -> list[str]:
    """Teardown and storm measure one attempt per request: no retries, no breaker (all routers
    take the same flags; mini_lb has neither feature)."""
    return ["--disable-retries", "--disable-circuit-breaker"]


def router_rss(c: Cluster) -> dict[str, Any]:
    rss = fds = conns = 0
    for p in c.router_tree():
        with contextlib.suppress(psutil.Error):
            rss += p.memory_info().rss
            fds += p.num_fds()
            conns += len(p.net_connections(kind="tcp"))
    return {"rss_mb": round(rss / 2**20, 2), "fds": fds, "tcp": conns}


def scenario_parser(doc: str | None) -> argparse.ArgumentParser:
    """The command line every scenario script shares: `--router` and `--quick`."""
    parser = argparse.ArgumentParser(description=doc)
    parser.add_argument("--router", default="trio_pd", choices=ROUTERS)
    parser.add_argument("--quick", action="store_true")
    return parser


def router_and_direct(c: Cluster, **base: Any) -> tuple[dict[str, Any], dict[str, Any], Any]:
    """The same load through the router, then straight at the engines (the client doing both
    legs itself): the baseline of every comparison. Returns (via, direct, router CPU meter result).
    """
    from bench.loadgen import LoadSpec, run_load

    meter = CpuMeter(c.pids())
    via = run_load(LoadSpec(mode="router", router_port=c.router_port, **base), meter=meter)
    direct = run_load(
        LoadSpec(
            mode="direct",
            prefill_port=c.prefill.port,
            decode_port=c.decode.port,
            bootstrap_port=c.prefill.bootstrap_port,
            **base,
        )
    )
    return via, direct, meter.result
