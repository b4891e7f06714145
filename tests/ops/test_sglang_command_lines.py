"""Command lines copied from SGLang's documentation start `trio-pd serve` and route.

Each line is taken as published, with only the workers' addresses (and the router's port)
replaced by the simulated engines' and a free port; `--prometheus-port` is added so the suite
never binds SGLang's default 29000 (it changes nothing else). What each line asks for is
checked from the engines' side: which worker got the request, with which bootstrap port.
A prefill listed without a bootstrap port serves it on SGLang's default, 8998, where a decode
engine looks when the router passes none (as a real deployment does).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx2
import pytest
import trio

from tests.conftest import start_engine
from tests.ops.serve import ServeProcess, free_port
from tests.router.helpers import generate_body
from trio_pd_testing.engine import EngineHandle

# SMG's README at the sglang-router 0.3.2 release (lightseekorg/smg c7f9bf9f5, README.md,
# "Prefill/Decode Disaggregation (PD)", Python launcher).
SMG_README_PD = (
    "python3 -m sglang_router.launch_router --pd-disaggregation "
    "--prefill http://prefill1:30001 9001 --prefill http://prefill2:30002 "
    "--decode http://decode1:30011 --decode http://decode2:30012 --policy cache_aware"
)
# SGLang's documentation, advanced_features/pd_disaggregation ("Start the router").
SGLANG_DOCS_PD = (
    "python -m sglang_router.launch_router --pd-disaggregation "
    "--prefill http://127.0.0.1:30000 --decode http://127.0.0.1:30001 --host 0.0.0.0 --port 8000"
)
# SMG's README at c7f9bf9f5, "MiniLB".
SMG_README_MINI_LB = (
    "python3 -m sglang_router.launch_router --mini-lb --pd-disaggregation "
    "--prefill http://localhost:30001 --decode http://localhost:30011"
)


def as_trio_pd(line: str, engines: dict[str, EngineHandle], port: int) -> list[str]:
    """The published line with `trio-pd serve` for the launcher and our engines for its workers.

    A worker URL becomes the engine's; a bootstrap port after a prefill URL becomes the engine's
    bootstrap port (the simulator picks its own); `--port` becomes a free port."""
    words = line.split()[3:]  # after "python -m sglang_router.launch_router"
    out: list[str] = []
    previous_engine: EngineHandle | None = None
    for word in words:
        if word in engines:
            previous_engine = engines[word]
            out.append(previous_engine.url)
            continue
        if previous_engine is not None and word.isdigit():
            out.append(str(previous_engine.bootstrap_port))
        elif out and out[-1] == "--port":
            out.append(str(port))
        else:
            out.append(word)
        previous_engine = None
    if "--port" not in out:
        out += ["--port", str(port)]
    return [*out, "--prometheus-port", str(free_port()), "--admin-port", str(free_port())]


async def start(argv: list[str], port: int, log_path: Path) -> ServeProcess:
    command = [sys.executable, "-m", "trio_pd", "serve", *argv]
    with open(log_path, "wb") as log:  # noqa: ASYNC230 - a local file, opened once
        process = await trio.lowlevel.open_process(command, stdout=log, stderr=subprocess.STDOUT)
    served = ServeProcess(process, port, str(log_path))
    await served.wait_ready()
    return served


def served_by(engine: EngineHandle) -> int:
    return len(engine.events.find("request_start"))


async def test_smg_readme_pd_line(
    nursery: trio.Nursery, tmp_path: Path, default_bootstrap_port: int
) -> None:
    """Two prefills (one with bootstrap port 9001, one without), two decodes, cache_aware."""
    engines = {
        "http://prefill1:30001": await start_engine(nursery, "prefill"),
        "http://prefill2:30002": await start_engine(
            nursery, "prefill", bootstrap_port=default_bootstrap_port
        ),
        "http://decode1:30011": await start_engine(nursery, "decode"),
        "http://decode2:30012": await start_engine(nursery, "decode"),
    }
    port = free_port()
    argv = as_trio_pd(SMG_README_PD, engines, port)
    assert argv.count("--prefill") == 2 and "9001" not in argv
    router = await start(argv, port, tmp_path / "router.log")
    try:
        async with httpx2.AsyncClient(base_url=router.url) as client:
            # cache_aware: the same prompt keeps its prefill and decode worker.
            prompt = "the same long prompt, " * 20
            for _ in range(4):
                response = await client.post("/generate", json=generate_body(text=prompt))
                assert response.status_code == 200, response.text
        prefills = [engines["http://prefill1:30001"], engines["http://prefill2:30002"]]
        decodes = [engines["http://decode1:30011"], engines["http://decode2:30012"]]
        assert sorted(served_by(e) for e in prefills) == [0, 4]
        assert sorted(served_by(e) for e in decodes) == [0, 4]
        chosen = next(e for e in prefills if served_by(e))
        seen = [e["body"]["bootstrap_port"] for e in chosen.events.find("request_start")]
        # The first prefill was given its bootstrap port, the second none (SGLang: null).
        expected = chosen.bootstrap_port if chosen is prefills[0] else None
        assert seen == [expected] * 4
    finally:
        await router.stop()


async def test_sglang_docs_pd_line(
    nursery: trio.Nursery, tmp_path: Path, default_bootstrap_port: int
) -> None:
    engines = {
        "http://127.0.0.1:30000": await start_engine(
            nursery, "prefill", bootstrap_port=default_bootstrap_port
        ),
        "http://127.0.0.1:30001": await start_engine(nursery, "decode"),
    }
    port = free_port()
    argv = as_trio_pd(SGLANG_DOCS_PD, engines, port)
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    router = await start(argv, port, tmp_path / "router.log")
    try:
        async with httpx2.AsyncClient(base_url=router.url) as client:
            response = await client.post(
                "/v1/chat/completions",
                json={"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            )
            assert response.status_code == 200, response.text
            assert response.json()["choices"][0]["message"]["content"]
        for engine in engines.values():
            assert served_by(engine) == 1
    finally:
        await router.stop()


@pytest.mark.parametrize("line", [SMG_README_MINI_LB])
async def test_smg_readme_mini_lb_line(
    nursery: trio.Nursery, tmp_path: Path, default_bootstrap_port: int, line: str
) -> None:
    engines = {
        "http://localhost:30001": await start_engine(
            nursery, "prefill", bootstrap_port=default_bootstrap_port
        ),
        "http://localhost:30011": await start_engine(nursery, "decode"),
    }
    port = free_port()
    router = await start(as_trio_pd(line, engines, port), port, tmp_path / "router.log")
    try:
        async with httpx2.AsyncClient(base_url=router.url) as client:
            response = await client.post("/generate", json=generate_body())
            assert response.status_code == 200, response.text
        assert all(served_by(engine) == 1 for engine in engines.values())
        assert "--mini-lb" in router.log() and "--policy random" in router.log()
    finally:
        await router.stop()
