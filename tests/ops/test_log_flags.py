"""`--log-dir` and `--log-level warn` on real `trio-pd serve` processes: the day's file (SMG's
daily rotation, our name), the same lines as the console, JSON lines and the access log in it,
`--workers 2` sharing the file without torn lines, an unusable directory failing the start."""

from __future__ import annotations

import logging
import signal
import time
from pathlib import Path

import httpx2
import orjson
import pytest
import trio

from tests.conftest import start_engine
from tests.ops.serve import ServeProcess, clients_per_process, start_serve
from tests.router.helpers import generate_body
from trio_pd.cli.main import build_parser, router_config
from trio_pd.observe.logs import DailyFileHandler, utc_day


def day_files(directory: Path) -> list[Path]:
    """The log files; a run that crossed midnight (UTC) has two."""
    files = sorted(directory.iterdir())
    days = {utc_day(time.time() - 3600), utc_day(time.time())}
    assert files and all(f.name in {f"trio-pd.{day}" for day in days} for f in files), files
    return files


def file_text(directory: Path) -> str:
    return "".join(f.read_text() for f in day_files(directory))


async def stop(router: ServeProcess) -> None:
    router.signal(signal.SIGTERM)
    assert await router.wait_exit() == 0


async def test_log_dir_gets_the_days_file(nursery: trio.Nursery, tmp_path: Path) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    log_dir = tmp_path / "not" / "yet"  # created, parents too (SMG: create_dir_all)
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "console.log"),
        "--log-dir", str(log_dir), "--access-log",
    )  # fmt: skip
    try:
        await router.wait_ready()
        async with httpx2.AsyncClient(base_url=router.url) as client:
            headers = {"x-request-id": "to-the-file"}
            response = await client.post("/generate", json=generate_body(), headers=headers)
            assert response.status_code == 200
        await stop(router)
    finally:
        await router.stop()
    text = file_text(log_dir)
    assert "trio-pd routing on http://127.0.0.1:" in text
    (access,) = [line for line in text.splitlines() if "trio_pd.access [to-the-file]" in line]
    assert "path=/generate status=200" in access
    assert "trio-pd stopped" in text
    # The console has the same lines.
    assert text.splitlines() == [
        line for line in router.log().splitlines() if line[:4].isdigit() and " trio_pd" in line
    ]


async def test_workers_share_the_file_in_whole_json_lines(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    log_dir = tmp_path / "logs"
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "console.log"),
        "--workers", "2", "--log-json", "--access-log", "--log-dir", str(log_dir),
    )  # fmt: skip
    clients: dict[int, httpx2.AsyncClient] = {}
    try:
        await router.wait_ready()
        clients = await clients_per_process(router)

        async def burst(client: httpx2.AsyncClient) -> None:
            for _ in range(20):
                assert (await client.post("/generate", json=generate_body())).status_code == 200

        async with trio.open_nursery() as both:  # both processes writing at the same time
            for client in clients.values():
                both.start_soon(burst, client)
        await stop(router)
    finally:
        for client in clients.values():
            await client.aclose()
        await router.stop()
    lines = [orjson.loads(line) for line in file_text(log_dir).splitlines()]  # none torn
    by_pid = {line["pid"] for line in lines}
    assert {router.process.pid, *clients} <= by_pid  # the supervisor and both processes
    access = [x for x in lines if x["logger"] == "trio_pd.access" and x["path"] == "/generate"]
    assert len(access) == 40 and {line["pid"] for line in access} == set(clients)


@pytest.mark.parametrize("level", ["warn", "info"])
async def test_log_level_warn(nursery: trio.Nursery, tmp_path: Path, level: str) -> None:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    log_dir = tmp_path / "logs"
    router = await start_serve(
        [prefill], [decode], str(tmp_path / "console.log"),
        "--log-dir", str(log_dir), "--log-level", level,
    )  # fmt: skip
    try:
        await router.wait_ready()
        await stop(router)
    finally:
        await router.stop()
    for text in (file_text(log_dir), router.log()):
        assert "WARNING trio_pd.edge.auth" in text  # no control-plane keys: a warning at start
        assert ("INFO trio_pd.serve.process" in text) == (level == "info")


def test_warn_is_sglangs_spelling_and_the_others_still_work() -> None:
    for level in ("debug", "info", "warn", "error", "warning", "critical"):
        assert router_config(build_parser().parse_args(["serve", "--log-level", level]))
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--log-level", "trace"])


async def test_an_unusable_log_dir_fails_the_start(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    router = await start_serve([], [], str(tmp_path / "console.log"), "--log-dir", str(not_a_dir))
    try:
        assert await router.wait_exit() == 1
    finally:
        await router.stop()
    assert f"trio-pd serve: error: --log-dir {not_a_dir}: " in router.log()
    assert "Traceback" not in router.log()


def test_a_new_utc_day_opens_a_new_file(tmp_path: Path) -> None:
    handler = DailyFileHandler(tmp_path)
    handler.setFormatter(logging.Formatter("%(message)s"))
    midnight = 1_798_761_600.0  # 2027-01-01T00:00:00Z
    for created, message in [(midnight - 1, "last"), (midnight, "first"), (midnight + 1, "next")]:
        record = logging.LogRecord("trio_pd", logging.INFO, __file__, 1, message, None, None)
        record.created = created
        handler.emit(record)
    handler.close()
    assert (tmp_path / "trio-pd.2026-12-31").read_text().endswith("last\n")
    assert (tmp_path / "trio-pd.2027-01-01").read_text() == "first\nnext\n"
