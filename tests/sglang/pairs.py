"""The tier's pairs: how they are started, shared by the fixtures and the recording script."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx2
import trio

from tests import processes
from tests.sglang import faults
from tests.sglang.fault_scenarios import Signals
from tests.sglang.scenarios import GEN, Observables, Target, abort, client, pd, wait_idle
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
        await serving_again(pair)

    return Signals(send, restart)


# An engine started again in place must serve a PD request before the session goes on. A
# restarted decode's Mooncake TCP transport listens on a random port; when that port is one a
# killed decode listened on before (the migration tests' extra decode, CI 2026-12-05), the
# prefill reuses its connection to the dead process: "Broken pipe", "Session ... failed", and
# every later transfer of the pair fails ("Failed to get kvcache from prefill instance, it might
# be dead"). A decode started again gets new ports. The same covers a prefill started again
# before its decode forgot the old one (docs/operations.md): the probe waits for a handshake that
# never comes, and a decode started again registers with the new prefill (clean-clone CI,
# 2026-12-05, after the shared-room crash).
SERVE_TRIES = 3
SERVE_PROBE_SECS = 60.0  # a first PD request after a restart waits for the new KV handshake


async def serving_again(pair: SGLangPair) -> None:
    """Until one engine-direct PD request gets 200 from both legs; when it does not, the
    decode is started again (above), at most `SERVE_TRIES` times, each printed."""
    t = target(pair)
    key = pair.admin_api_key or pair.api_key
    for attempt in range(1, SERVE_TRIES + 1):
        statuses: tuple[int, int] | None = None
        async with client() as c:
            with trio.move_on_after(SERVE_PROBE_SECS):
                p, d = await pd(t, c, "/generate", GEN)
                statuses = (p.status, d.status)
            if statuses == (200, 200):
                return
            for url in (pair.prefill_url, pair.decode_url):  # what the probe left held
                await abort(c, url, {"abort_all": True}, key)
        print(
            f"\nattempt {attempt}: the restarted pair served no PD request ({statuses}): "
            "the decode started again",
            file=sys.stderr,
        )
        with processes.outliving_the_test("decode restarted: the pair served nothing"):
            await trio.to_thread.run_sync(pair.restart, "decode")
    raise AssertionError(f"the pair served no PD request after {SERVE_TRIES} decode restarts")


def main_flags() -> list[str]:
    return [
        f"--context-length {PREFILL_CONTEXT_LENGTH} (prefill only)",
        f"--chunked-prefill-size {PREFILL_CHUNK} (prefill only)",
    ]


# What SGLang 0.5.23's prefill scheduler raises, and dies of, when two samples of one request
# share a bootstrap room and one of them starts its KV transfer while the other still waits in
# the bootstrap queue (disaggregation/prefill.py `pop_bootstrapped`: "Unexpected poll state 3",
# the room's sender already Transferring). The whole prefill server exits ~5 s later.
SHARED_ROOM_CRASH = "Unexpected poll state"
SHARED_ROOM_TRIES = 3


async def past_shared_room_crashes(
    pair: SGLangPair, run: Callable[[], Awaitable[Observables]]
) -> Observables:
    """Run a scenario whose `n: 2` samples share one room (`scenarios.SHARED_ROOM`) until it
    runs without the prefill crash above, at most `SHARED_ROOM_TRIES` times.

    The crash is a race between the two samples (twice on 2026-12-05 after many runs without
    it; in CI every later test of the session found the prefill dead). The
    scenario records what the engine does when the race is not lost; a lost race is retried
    only when the prefill's own log says it is this crash, or when the scenario's requests
    timed out (the race can also leave the prefill silent); anything else fails the test as
    before: the decode's hung samples are aborted (`abort_all`), the prefill started again
    on its own ports, and the scenario run again. Each crash is printed."""
    for attempt in range(1, SHARED_ROOM_TRIES + 1):
        log = pair.prefill.log_path
        start = log.stat().st_size
        forgotten = faults.losses(pair.decode, pair.bootstrap_port)
        try:
            observed = await run()
        except BaseException as exc:
            # The race's other outcome: the prefill never answers (clean-clone CI, 2026-12-05:
            # both legs timed out after 60 s, no crash line). Handled as the crash.
            if not (_timed_out(exc) or await _crashed_since(pair, start)):
                raise
        else:
            if not await _crashed_since(pair, start, wait=0.0):
                return observed
        print(
            f"\nattempt {attempt}: the prefill crashed ({SHARED_ROOM_CRASH!r}) or went silent "
            "(two samples on one room): its decode cleared, the prefill started again",
            file=sys.stderr,
        )
        key = pair.admin_api_key or pair.api_key
        async with client() as c:
            await abort(c, pair.decode_url, {"abort_all": True}, key)
            await wait_idle(c, pair.decode_url, timeout=30, key=key)
        # A prefill started again before its decode forgot the old one is never registered
        # with (`faults.decode_forgets`): serving_again would then restart the decode too, after
        # a 60 s probe. So the prefill is killed (a silent one is alive) and the decode's log
        # watched for the loss first; a decode that does not show it in time is left to
        # serving_again as before.
        await trio.to_thread.run_sync(pair.prefill.kill)
        with contextlib.suppress(trio.TooSlowError):  # after faults.FORGET_SECS
            await faults.decode_forgets(pair.decode, pair.bootstrap_port, forgotten)
        await signals(pair).restart("prefill")
    raise AssertionError(f"the prefill crashed on each of {SHARED_ROOM_TRIES} tries")


def _timed_out(exc: BaseException) -> bool:
    """A client timeout anywhere in `exc` (a nursery's group nests them)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(_timed_out(e) for e in exc.exceptions)
    return isinstance(exc, httpx2.TimeoutException)


async def _crashed_since(pair: SGLangPair, offset: int, wait: float = 10.0) -> bool:
    """The prefill's log shows the shared-room crash after `offset` (waiting up to `wait` s
    for the line: a scenario's request can fail as the scheduler dies, before it logs)."""
    with trio.move_on_after(wait):
        while True:
            with pair.prefill.log_path.open("rb") as f:
                f.seek(offset)
                if SHARED_ROOM_CRASH.encode() in f.read():
                    return True
            if wait == 0.0:
                return False
            await trio.sleep(0.1)
    return False
