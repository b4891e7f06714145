"""Start and stop a real SGLang 0.5.23 prefill/decode pair on this CPU-only machine.

One place for the real-engine tier (`tests/sglang/`), `make demo-sglang` and the benchmarks. It
runs under the router's venv and starts the stock `sglang.launch_server` as subprocesses of the
separate `.venv-sglang` (`make sglang-env`), each in its own process group, so `stop()` can end
the HTTP server, its scheduler, detokenizer and resource-tracker children together.

Synchronous on purpose (subprocess + polling): pytest-trio cannot run session-scoped async
fixtures, and a pair costs ~30 s and ~3 GB of RAM per server, so the tier starts it once.

What makes the stock engine run here (docs/sglang-tier.md):
- `SGLANG_USE_CPU_ENGINE=1` and the CPU flags in `COMMON_ARGS`;
- `pythonpath/` on the engines' PYTHONPATH only: a stub `sgl_kernel` and a `sitecustomize`
  that turns off `MooncakeKVSender.supports_host_tensor_indices` (see those files for why);
- `SGLANG_HOST_IP=127.0.0.1`: Mooncake's TCP transport and the bootstrap registration otherwise
  advertise the machine's first NIC address; here all traffic stays on loopback.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[2]
# The engines' own environment; `make sglang-env` creates it.
VENV = Path(os.environ.get("TRIO_PD_SGLANG_VENV", REPO_ROOT / ".venv-sglang"))
ENGINE_PYTHON = VENV / "bin" / "python"
MODEL_DIR = Path(os.environ.get("TRIO_PD_SGLANG_MODEL", REPO_ROOT / ".cache" / "sglang-tiny-model"))
ENGINE_PYTHONPATH = PACKAGE_DIR / "pythonpath"
SERVED_MODEL_NAME = "trio-pd-tiny-llama"
SGLANG_VERSION = "0.5.23"

# Flags every engine of the tier gets. The KV pool and the running-request cap are bounded:
# left alone, SGLang sizes the CPU KV cache from free RAM (14 GB for this tiny model, measured)
# and a second server is then killed by the OOM killer.
COMMON_ARGS: tuple[str, ...] = (
    "--load-format", "dummy",
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    # Else each idle scheduler busy-polls a core.
    "--sleep-on-idle",
    "--skip-server-warmup",
    # `fake` cannot serve a pair: prefill refuses it, decode crashes on a real bootstrap_host.
    "--disaggregation-transfer-backend", "mooncake_tcp",
    "--max-total-tokens", "32768",
    "--max-running-requests", "32",
)  # fmt: skip
# Else decode pins host memory for retraction through CUDA at start-up.
DECODE_ARGS: tuple[str, ...] = ("--disaggregation-decode-retraction-backup", "cpu_tensor")

ENGINE_ENV: dict[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HOST_IP": "127.0.0.1",
    # The model is written locally; nothing may be fetched from a hub.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "PYTHONUNBUFFERED": "1",
}


class EngineStartError(RuntimeError):
    """An engine died or did not become ready; the message carries its log tail."""


def free_port() -> int:
    """A port free on 127.0.0.1 now (the engine binds it a few seconds later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def distinct_free_ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


def check_environment() -> None:
    if not ENGINE_PYTHON.exists():
        raise EngineStartError(f"{ENGINE_PYTHON} is missing: run `make sglang-env` first")


def ensure_model(directory: Path = MODEL_DIR) -> Path:
    """Write the tiny model once (under the engines' python, which has `tokenizers`)."""
    check_environment()
    subprocess.run(
        [str(ENGINE_PYTHON), str(PACKAGE_DIR / "make_model.py"), str(directory)],
        check=True,
        env={**os.environ, **ENGINE_ENV},
    )
    return directory


def http_status(url: str, timeout: float = 2.0, headers: dict[str, str] | None = None) -> int:
    """The status of a GET, 0 when nothing answers."""
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except (OSError, TimeoutError):
        return 0


def group_pids(pgid: int) -> list[int]:
    """Live processes of a process group (zombies excluded), read from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def sglang_shm_files() -> set[str]:
    """SGLang's load-snapshot segments: it unlinks them only on a graceful exit."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    return {p.name for p in shm.iterdir() if p.name.startswith(("sglang_loads_", "sgl_shm_"))}


@dataclass
class Engine:
    """One `sglang.launch_server` process group."""

    role: str
    port: int
    process: subprocess.Popen
    log_path: Path
    command: list[str]
    bootstrap_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def pids(self) -> list[int]:
        """Every live process of this engine: the server, its scheduler, detokenizer, ..."""
        return group_pids(self.process.pid)

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def kill(self, timeout: float = 20.0) -> None:
        """SIGKILL the whole group, wait until none of it lives, then reap the leader.

        SIGTERM to the server takes ~12 s (it sleeps 5 s for "crash diagnostics" when a child
        ends first) and still leaves its shared-memory files behind, so the tier kills.
        """
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while self.pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        left = self.pids()
        if left:
            raise RuntimeError(f"{self.role} engine: processes {left} survived SIGKILL")


def engine_command(
    role: str,
    port: int,
    *,
    bootstrap_port: int | None = None,
    context_length: int | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    extra_args: Sequence[str] = (),
    model_dir: Path = MODEL_DIR,
) -> list[str]:
    command = [
        str(ENGINE_PYTHON), "-m", "sglang.launch_server",
        "--model-path", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--disaggregation-mode", role,
        *COMMON_ARGS,
    ]  # fmt: skip
    if role == "prefill":
        if bootstrap_port is None:
            raise ValueError("a prefill needs its bootstrap port")
        command += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    else:
        command += list(DECODE_ARGS)
    if context_length is not None:
        command += ["--context-length", str(context_length)]
    if api_key is not None:
        command += ["--api-key", api_key]
    if admin_api_key is not None:
        command += ["--admin-api-key", admin_api_key]
    return command + list(extra_args)


def spawn_engine(role: str, port: int, log_path: Path, command: list[str], **kw) -> Engine:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(ENGINE_PYTHONPATH)}
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=str(log_path.parent),
            start_new_session=True,
        )
    return Engine(role, port, process, log_path, command, **kw)


def wait_ready(engines: Sequence[Engine], timeout: float) -> None:
    """Poll `GET /ready` (cheap: no generation, unlike `/health`) until every engine says 200.

    A process that exits meanwhile fails the start at once with its log tail.
    """
    deadline = time.monotonic() + timeout
    waiting = list(engines)
    while waiting:
        for engine in list(waiting):
            if not engine.alive():
                raise EngineStartError(
                    f"{engine.role} engine exited with {engine.process.returncode} during "
                    f"start-up; log {engine.log_path}:\n{engine.log_tail()}"
                )
            if http_status(engine.url + "/ready", timeout=1.0) == 200:
                waiting.remove(engine)
        if not waiting:
            return
        if time.monotonic() > deadline:
            names = ", ".join(e.role for e in waiting)
            tails = "\n".join(f"--- {e.role} ({e.log_path}):\n{e.log_tail(30)}" for e in waiting)
            raise EngineStartError(f"{names} not ready after {timeout:.0f} s\n{tails}")
        time.sleep(0.25)


# Pairs start one at a time, so the shared-memory files a start creates are its own.
_start_lock = threading.Lock()


@dataclass
class SGLangPair:
    """A real prefill and decode, the KV cache handed over by Mooncake on TCP."""

    prefill: Engine
    decode: Engine
    startup_secs: float
    api_key: str | None = None
    admin_api_key: str | None = None
    shm_files: set[str] = field(default_factory=set)

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def bootstrap_port(self) -> int:
        assert self.prefill.bootstrap_port is not None
        return self.prefill.bootstrap_port

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return (self.prefill, self.decode)

    @classmethod
    def start(
        cls,
        *,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        api_key: str | None = None,
        admin_api_key: str | None = None,
        prefill_context_length: int | None = None,
        decode_context_length: int | None = None,
        log_dir: Path | str,
        name: str = "pair",
        timeout: float = 300.0,
    ) -> SGLangPair:
        """Start both engines at once and wait until both answer `/ready`.

        Logs go to `log_dir/<name>-prefill.log` and `-decode.log` (appended). On any failure
        whatever was started is killed before the error propagates. A port taken between
        choosing it and the engine binding it (other engines open many sockets at start-up;
        measured once in a full tier run) gets new ports, up to three tries.
        """
        for attempt in range(3):
            try:
                return cls._start_once(
                    prefill_args=prefill_args,
                    decode_args=decode_args,
                    api_key=api_key,
                    admin_api_key=admin_api_key,
                    prefill_context_length=prefill_context_length,
                    decode_context_length=decode_context_length,
                    log_dir=log_dir,
                    name=name,
                    timeout=timeout,
                )
            except EngineStartError as e:
                if "address already in use" not in str(e) or attempt == 2:
                    raise
        raise AssertionError("unreachable")

    @classmethod
    def _start_once(
        cls,
        *,
        prefill_args: Sequence[str],
        decode_args: Sequence[str],
        api_key: str | None,
        admin_api_key: str | None,
        prefill_context_length: int | None,
        decode_context_length: int | None,
        log_dir: Path | str,
        name: str,
        timeout: float,
    ) -> SGLangPair:
        check_environment()
        model = ensure_model()
        log_dir = Path(log_dir)
        with _start_lock:
            before = sglang_shm_files()
            prefill_port, bootstrap_port, decode_port = distinct_free_ports(3)
            keys: dict[str, Any] = {"api_key": api_key, "admin_api_key": admin_api_key}
            started: list[Engine] = []
            t0 = time.monotonic()
            try:
                started.append(
                    spawn_engine(
                        "prefill",
                        prefill_port,
                        log_dir / f"{name}-prefill.log",
                        engine_command(
                            "prefill",
                            prefill_port,
                            bootstrap_port=bootstrap_port,
                            context_length=prefill_context_length,
                            extra_args=prefill_args,
                            model_dir=model,
                            **keys,
                        ),
                        bootstrap_port=bootstrap_port,
                    )
                )
                started.append(
                    spawn_engine(
                        "decode",
                        decode_port,
                        log_dir / f"{name}-decode.log",
                        engine_command(
                            "decode",
                            decode_port,
                            context_length=decode_context_length,
                            extra_args=decode_args,
                            model_dir=model,
                            **keys,
                        ),
                    )
                )
                wait_ready(started, timeout)
            except BaseException:
                for engine in started:
                    engine.kill()
                _unlink_shm(sglang_shm_files() - before)
                raise
            pair = cls(started[0], started[1], time.monotonic() - t0, api_key, admin_api_key)
            pair.shm_files = sglang_shm_files() - before
            return pair

    def pids(self) -> list[int]:
        return [pid for engine in self.engines for pid in engine.pids()]

    def stop(self) -> None:
        """Kill both process groups; raises if any process of either survives."""
        errors = []
        for engine in self.engines:
            try:
                engine.kill()
            except RuntimeError as e:
                errors.append(str(e))
        _unlink_shm(self.shm_files)
        if errors:
            raise RuntimeError("; ".join(errors))

    def restart(self, role: str, timeout: float = 300.0) -> float:
        """Start one engine again on its own ports (after a fault killed it); seconds taken.

        The same command, so the same HTTP and bootstrap ports: a router in front keeps its
        URLs. Whatever is left of the old process group is killed first.
        """
        old = self.prefill if role == "prefill" else self.decode
        old.kill()
        with _start_lock:
            before = sglang_shm_files()
            t0 = time.monotonic()
            engine = spawn_engine(
                role, old.port, old.log_path, old.command, bootstrap_port=old.bootstrap_port
            )
            try:
                wait_ready([engine], timeout)
            except BaseException:
                engine.kill()
                raise
            if role == "prefill":
                self.prefill = engine
            else:
                self.decode = engine
            self.shm_files |= sglang_shm_files() - before
            return time.monotonic() - t0

    def __enter__(self) -> SGLangPair:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def describe(self) -> str:
        return (
            f"prefill {self.prefill_url} (bootstrap {self.bootstrap_port}, pid "
            f"{self.prefill.pid}), decode {self.decode_url} (pid {self.decode.pid}), ready in "
            f"{self.startup_secs:.1f} s"
        )


def _unlink_shm(names: set[str]) -> None:
    for name in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join("/dev/shm", name))


@contextlib.contextmanager
def running_pair(**kwargs) -> Iterator[SGLangPair]:
    pair = SGLangPair.start(**kwargs)
    try:
        yield pair
    finally:
        pair.stop()
