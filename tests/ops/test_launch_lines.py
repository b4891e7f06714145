"""An example of `smg launch --help` (SMG 1.13.0) starts a real `trio-pd launch` and routes.

The line is SMG's own (tests/data/smg_1.13.0_flags.json `help_examples`, "PD disaggregated mode
with same policy for both"), with only the workers' addresses replaced by simulated engines' and
free ports for the router's listeners (`--prometheus-port`, `--admin-port`: the suite never
binds 29000), plus one flag a PD router ignores. What it asks for is checked from the engines'
side, and one of 1.13's meanings from the client's: no cross-origin allowance without
`--cors-allowed-origins`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx2
import trio

from tests.conftest import start_engine
from tests.ops.serve import ServeProcess, free_port
from tests.ops.test_sglang_command_lines import as_trio_pd, served_by
from tests.router.helpers import generate_body
from tests.test_launch import help_examples


async def start_launch(argv: list[str], port: int, log_path: Path) -> ServeProcess:
    command = [sys.executable, "-m", "trio_pd", "launch", *argv]
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local file, opened once
        process = await trio.lowlevel.open_process(command, stdout=log, stderr=subprocess.STDOUT)
    served = ServeProcess(process, port, str(log_path))
    await served.wait_ready()
    return served


async def test_smg_help_pd_line_routes(
    nursery: trio.Nursery, tmp_path: Path, default_bootstrap_port: int
) -> None:
    """Two prefills (bootstrap port 9000, and none), two decodes, cache_aware."""
    line = "python -m smg.launch_router " + " ".join(help_examples()[1])
    assert "--prefill http://prefill1:8000 9000 --prefill http://prefill2:8000" in line
    engines = {
        "http://prefill1:8000": await start_engine(nursery, "prefill"),
        "http://prefill2:8000": await start_engine(
            nursery, "prefill", bootstrap_port=default_bootstrap_port
        ),
        "http://decode1:8001": await start_engine(nursery, "decode"),
        "http://decode2:8001": await start_engine(nursery, "decode"),
    }
    port = free_port()
    argv = [*as_trio_pd(line, engines, port), "--kv-index", "chain", "--host", "127.0.0.1"]
    router = await start_launch(argv, port, tmp_path / "router.log")
    try:
        async with httpx2.AsyncClient(base_url=router.url) as client:
            prompt = "the same long prompt, " * 20
            for _ in range(3):
                response = await client.post(
                    "/generate",
                    json=generate_body(text=prompt),
                    headers={"origin": "http://browser.example"},
                )
                assert response.status_code == 200, response.text
                assert "access-control-allow-origin" not in response.headers
        prefills = [engines["http://prefill1:8000"], engines["http://prefill2:8000"]]
        decodes = [engines["http://decode1:8001"], engines["http://decode2:8001"]]
        # cache_aware: the same prompt keeps its prefill and its decode worker.
        assert sorted(served_by(e) for e in prefills) == [0, 3]
        assert sorted(served_by(e) for e in decodes) == [0, 3]
        chosen = next(e for e in prefills if served_by(e))
        seen = [e["body"]["bootstrap_port"] for e in chosen.events.find("request_start")]
        assert seen == [chosen.bootstrap_port if chosen is prefills[0] else None] * 3
        assert "--kv-index is ignored" in router.log()
    finally:
        await router.stop()
