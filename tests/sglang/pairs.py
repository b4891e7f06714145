"""The tier's pairs: how they are started, shared by the fixtures and the recording script."""

from __future__ import annotations

import os
from pathlib import Path

import trio

from tests import processes
from tests.sglang.fault_scenarios import Signals
from tests.sglang.scenarios import Target
from trio_pd_testing.sglang import SGLangPair

# The main pair's prefill accepts 1024 tokens, its decode 4096 (the model's): a prompt between
# the two gets a real prefill 400 while its decode waits for KV.
PREFILL_CONTEXT_LENGTH = 1024
# Its prefill computes a prompt in chunks of 256 tokens (SGLang's default, 4096, is above the
# context: nothing would be chunked), so an abort can land mid chunked prefill (SGLang PR
# #35255's race: test_fault_matrix.py `test_abort_mid_chunked_prefill`).
PREFILL_CHUNK = 256
API_KEY = "tier-generation-key"
ADMIN_API_KEY = "tier-admin-key"
LOG_DIR = Path(__file__).resolve().parents[2] / ".cache" / "sglang-logs"


def start_main(log_dir: Path = LOG_DIR) -> SGLangPair:
    return SGLangPair.start(
        prefill_args=("--chunked-prefill-size", str(PREFILL_CHUNK)),
        prefill_context_length=PREFILL_CONTEXT_LENGTH,
        log_dir=log_dir,
        name="main",
    )


def start_admin(log_dir: Path = LOG_DIR) -> SGLangPair:
    """Both engines with --api-key and --admin-api-key (prefill context as the main pair's)."""
    return SGLangPair.start(
        api_key=API_KEY,
        admin_api_key=ADMIN_API_KEY,
        prefill_context_length=PREFILL_CONTEXT_LENGTH,
        log_dir=log_dir,
        name="admin",
    )


def target(pair: SGLangPair) -> Target:
    return Target(
        pair.prefill_url,
        pair.decode_url,
        pair.bootstrap_port,
        api_key=pair.api_key,
        admin_api_key=pair.admin_api_key,
    )


def signals(pair: SGLangPair) -> Signals:
    """Real signals to the pair's engines (each engine's whole process group), and a killed
    engine started again on its own ports."""

    def send(role: str, signum: int) -> None:
        os.killpg((pair.prefill if role == "prefill" else pair.decode).pid, signum)

    async def restart(role: str) -> None:
        # The engine started again is the session pair's, not the test's: without this the
        # test's reaper (tests/processes.py) killed it as the test ended, and every later test
        # of the session found the decode dead (make test-sglang, 2026-12-05, twice).
        with processes.outliving_the_test(f"{role} restarted by a fault scenario"):
            await trio.to_thread.run_sync(pair.restart, role)

    return Signals(send, restart)


def main_flags() -> list[str]:
    return [
        f"--context-length {PREFILL_CONTEXT_LENGTH} (prefill only)",
        f"--chunked-prefill-size {PREFILL_CHUNK} (prefill only)",
    ]
