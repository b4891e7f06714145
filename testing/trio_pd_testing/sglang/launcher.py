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
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trio_pd_testing import real_pair

# What both real-engine tiers share lives in `trio_pd_testing/real_pair.py`; named here too, where
# the SGLang tier's tests and tools have always imported them from.
from trio_pd_testing.real_pair import Engine as Engine
from trio_pd_testing.real_pair import EngineStartError as EngineStartError
from trio_pd_testing.real_pair import PairBase, with_port_retries
from trio_pd_testing.real_pair import distinct_free_ports as distinct_free_ports
from trio_pd_testing.real_pair import free_port as free_port
from trio_pd_testing.real_pair import group_pids as group_pids
from trio_pd_testing.real_pair import http_status as http_status

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[2]  # the checkout (testing/trio_pd_testing/<tier>/launcher.py)
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


def check_environment() -> None:
    real_pair.check_venv(ENGINE_PYTHON, "sglang-env")


def ensure_model(directory: Path = MODEL_DIR) -> Path:
    """Write the tiny model once."""
    check_environment()
    env = {**os.environ, **ENGINE_ENV}
    return real_pair.write_model(ENGINE_PYTHON, PACKAGE_DIR / "make_model.py", directory, env)


def sglang_shm_files() -> set[str]:
    """SGLang's load-snapshot segments: it unlinks them only on a graceful exit."""
    shm = Path("/dev/shm")
    if not shm.is_dir():
        return set()
    return {p.name for p in shm.iterdir() if p.name.startswith(("sglang_loads_", "sgl_shm_"))}


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
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(ENGINE_PYTHONPATH)}
    return real_pair.spawn_engine(role, port, log_path, command, env, **kw)


def wait_ready(engines: Sequence[Engine], timeout: float) -> None:
    """Poll `GET /ready` (cheap: no generation, unlike `/health`) until every engine says 200.

    A process that exits meanwhile fails the start at once with its log tail.
    """
    real_pair.wait_ready(engines, timeout, "/ready", poll_secs=0.25, probe_secs=1.0)


# Pairs start one at a time, so the shared-memory files a start creates are its own.
_start_lock = threading.Lock()


@dataclass
class SGLangPair(PairBase):
    """A real prefill and decode, the KV cache handed over by Mooncake on TCP."""

    api_key: str | None = None
    admin_api_key: str | None = None
    shm_files: set[str] = field(default_factory=set)

    @property
    def bootstrap_port(self) -> int:
        assert self.prefill.bootstrap_port is not None
        return self.prefill.bootstrap_port

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
        return with_port_retries(
            lambda: cls._start_once(
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
        )

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

    def stop(self) -> None:
        """Kill both process groups; raises if any process of either survives."""
        errors = self.kill_engines()
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
