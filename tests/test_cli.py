"""The real command line: `python -m trio_pd serve` as a separate process, one and two workers;
and the router's wheel, which holds the router only."""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path

import httpx2
import pytest
import trio

from tests.conftest import start_engine
from tests.router.helpers import generate_body
from trio_pd.cli.main import build_parser, main, router_config
from trio_pd_testing.ports import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_flags_follow_sglang_router() -> None:
    args = build_parser().parse_args(
        [
            "serve",
            "--prefill", "http://10.0.0.1:30000", "8998",
            "--prefill", "http://[::1]:30000/", "none",
            "--prefill", "http://10.0.0.3:30000",
            "--decode", "http://10.0.0.2:30000",
            "--policy", "power_of_two",
            "--disable-retries",
            "--cb-failure-threshold", "4",
        ]
    )  # fmt: skip
    config = router_config(args)
    assert [(w.url, w.bootstrap_port) for w in config.prefill] == [
        ("http://10.0.0.1:30000", 8998),
        ("http://[::1]:30000", None),
        ("http://10.0.0.3:30000", None),
    ]
    assert [w.url for w in config.decode] == ["http://10.0.0.2:30000"]
    assert config.port == 30000
    assert config.host == "0.0.0.0"
    assert config.policy.policy == "power_of_two"
    assert config.retry.enabled is False
    assert config.breaker.failure_threshold == 4
    assert config.request_timeout_secs == 1800
    assert config.max_payload_size == 536_870_912


def test_bad_worker_url_is_refused() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefill", "ftp://x", "--decode", "http://y"])


def imported_modules(importtime_log: str) -> set[str]:
    """The modules a `python -X importtime` process imported, from its stderr."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            names.add(line.rsplit("|", 1)[1].strip())
    return names


@pytest.mark.parametrize("workers", [1, 2])
async def test_serve_command_routes_and_stops_on_sigint(
    nursery: trio.Nursery, workers: int, tmp_path
) -> None:
    """Also: the serving process, and each of its workers, imports no simulator module while it
    starts, routes and stops (`-X importtime` logs every import, however late; issue 31)."""
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    port = free_port()
    command = [
        sys.executable, "-X", "importtime", "-m", "trio_pd", "serve",
        "--prefill", prefill.url, str(prefill.bootstrap_port),
        "--decode", decode.url,
        "--host", "127.0.0.1", "--port", str(port),
        "--workers", str(workers), "--log-level", "warning",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        "--admin-port", str(free_port()),
    ]  # fmt: skip
    stderr = (tmp_path / "stderr").open("w")
    process = await trio.lowlevel.open_process(command, stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        async with httpx2.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
            with trio.fail_after(30):
                while True:
                    try:
                        if (await client.get("/readiness")).status_code == 200:
                            break
                    except httpx2.TransportError:
                        pass
                    await trio.sleep(0.1)
            for _ in range(6):
                response = await client.post("/generate", json=generate_body())
                assert response.status_code == 200
            failed = await client.post("/generate", json=generate_body(sim_fault="prefill:500@100"))
            assert failed.status_code == 502
            rid = failed.headers["x-request-id"]
            await decode.events.wait_for("connection_closed", timeout=5, rid=rid)
        process.send_signal(signal.SIGINT)
        with trio.fail_after(20):
            code = await process.wait()
        assert code == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
        stderr.close()
    assert len(decode.events.find("slot_freed", reason="finished")) == 6
    imported = imported_modules((tmp_path / "stderr").read_text())
    assert {"trio_pd.serve.run", "trio_pd.pd.dispatch"} <= imported  # the log is the router's
    assert sorted(name for name in imported if name.startswith("trio_pd_testing")) == []


def test_edge_flags_keep_sglang_router_defaults_and_values() -> None:
    parser = build_parser()
    config = router_config(parser.parse_args(["serve"]))
    assert config.request_id_headers is None  # the router's default list
    assert config.cors_allowed_origins == ()  # any origin
    assert config.rate_limit_tokens_per_second is None  # = --max-concurrent-requests
    assert config.breaker.window_duration_secs == 120
    config = router_config(
        parser.parse_args(
            [
                "serve",
                "--request-id-headers", "X-Trace-Id", "my-id",
                "--cors-allowed-origins", "http://a.example", "https://b.example:8443",
                "--rate-limit-tokens-per-second", "5",
                "--cb-window-duration-secs", "30",
            ]
        )
    )  # fmt: skip
    assert config.request_id_headers == ("X-Trace-Id", "my-id")
    assert config.cors_allowed_origins == ("http://a.example", "https://b.example:8443")
    assert config.rate_limit_tokens_per_second == 5
    assert config.breaker.window_duration_secs == 30
    # The flag given with no header: no client id is ever taken (SMG passes an empty list on).
    empty = router_config(parser.parse_args(["serve", "--request-id-headers"]))
    assert empty.request_id_headers == ()


@pytest.mark.parametrize(
    "argv",
    [
        ["--cb-window-duration-secs", "0"],  # SMG: "Must be > 0"
        ["--rate-limit-tokens-per-second", "-2"],  # SMG: "Must be >= 0 when specified"
        ["--cors-allowed-origins", "*"],  # SMG 0.3.2 panics at startup
        ["--cors-allowed-origins", "http://a.example", ""],
    ],
)
def test_edge_flags_refuse_what_sglang_router_refuses(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        router_config(build_parser().parse_args(["serve", *argv]))


def test_memory_flags_reach_the_config_and_bad_values_are_refused() -> None:
    parser = build_parser()
    base = ["serve", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    default = router_config(parser.parse_args(base))
    assert (default.max_buffered_bytes, default.max_sse_event_bytes) == (2 << 30, 16 << 20)
    config = router_config(
        parser.parse_args([*base, "--max-buffered-bytes", "123456", "--max-sse-event-bytes", "77"])
    )
    assert (config.max_buffered_bytes, config.max_sse_event_bytes) == (123456, 77)
    assert (
        router_config(parser.parse_args([*base, "--max-buffered-bytes", "0"])).max_buffered_bytes
        == 0
    )
    for bad in (["--max-buffered-bytes", "-1"], ["--max-sse-event-bytes", "0"]):
        with pytest.raises(SystemExit):
            router_config(parser.parse_args([*base, *bad]))


def test_the_routers_wheel_holds_the_router_only(tmp_path: Path) -> None:
    """Built offline from a copy of the checkout's packaging (the router's pyproject.toml,
    README.md and trio_pd/, as the Dockerfile copies them, beside the test engines' testing/),
    the router's wheel holds trio_pd/'s modules, all of them, and nothing of the test engines
    (`trio_pd_testing`, testing/pyproject.toml): no simulator, launcher or demo (issue 31)."""
    source = tmp_path / "source"
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    for name in ("trio_pd", "testing"):
        shutil.copytree(ROOT / name, source / name, ignore=skip)
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         "--no-index", "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "dist").glob("trio_pd-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
        commands = archive.read(entry_points).decode()
    modules = {n for n in names if n.endswith(".py")}
    router = {p.relative_to(ROOT).as_posix() for p in (ROOT / "trio_pd").rglob("*.py")}
    assert "trio_pd/serve/run.py" in modules and "trio_pd/cli/main.py" in modules
    assert modules == router
    assert [n for n in names if n.startswith(("trio_pd_testing", "trio_pd/testing"))] == []
    assert "trio-pd = trio_pd.cli.main:main" in commands and "trio-pd-testing" not in commands


@pytest.mark.parametrize("command", ["engine", "demo"])
def test_the_test_engines_commands_moved(command: str) -> None:
    """`trio-pd engine` and `trio-pd demo` are the test engines' now: the router says where."""
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert f"`trio-pd-testing {command}`" in str(exited.value.code)
