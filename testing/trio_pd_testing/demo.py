"""`make demo`: one prefill engine, one decode engine and the router, each a subprocess.

Shows a normal request, a streaming request, and a request whose prefill fails; for the last one
it reads the engines' event logs to show how quickly the router released the decode engine.
Everything started here is stopped on exit (and on Ctrl-C).

The router command is `python -m trio_pd serve ...`; TRIO_PD_DEMO_ROUTER_MODULE replaces the
module name (for trying the demo against another router speaking the same CLI).
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx2
import orjson
import trio

from trio_pd_testing.ports import free_port

HOST = "127.0.0.1"
STARTUP_TIMEOUT = 20.0
WIDTH = 34


def line(label: str, value: Any) -> None:
    print(f"  {label:<{WIDTH}} {value}")


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [orjson.loads(raw) for raw in path.read_bytes().splitlines() if raw.strip()]


async def wait_for_event(path: Path, within: float, **fields: Any) -> dict[str, Any] | None:
    """Poll an engine's JSON-lines event file (another process writes it)."""
    with trio.move_on_after(within):
        while True:
            for record in read_events(path):
                if all(record.get(k) == v for k, v in fields.items()):
                    return record
            await trio.sleep(0.05)
    return None


async def wait_healthy(client: httpx2.AsyncClient, name: str, url: str, proc: Any) -> None:
    with trio.fail_after(STARTUP_TIMEOUT):
        while True:
            if proc.returncode is not None:
                raise RuntimeError(f"{name} exited with status {proc.returncode}")
            try:
                # SGLang-like /health is a 1-token generation of >= 1 s: a 1 s timeout never passes
                if (await client.get(url + "/health", timeout=3.0)).status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            await trio.sleep(0.1)


class Demo:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.prefill_port, self.bootstrap_port = free_port(), free_port()
        self.decode_port, self.router_port = free_port(), free_port()
        self.metrics_port = free_port()  # not 29000: a router already running may hold it
        self.admin_port = free_port()  # nor 29001
        self.prefill_events = workdir / "prefill-events.jsonl"
        self.decode_events = workdir / "decode-events.jsonl"
        self.router = f"http://{HOST}:{self.router_port}"
        self.failed = False
        self.unexpected: list[str] = []

    def expect(self, ok: bool, what: str) -> None:
        """A step's promised outcome: one that did not happen is printed and fails the demo
        (exit 1), so `make demo` in CI proves the README's claims, not only that it ran."""
        if not ok:
            print(f"  UNEXPECTED: {what}")
            self.unexpected.append(what)
            self.failed = True

    def commands(self) -> dict[str, list[str]]:
        py = sys.executable
        common = ["--host", HOST, "--disconnect-poll-secs", "1", "--waiting-timeout", "30"]
        common += ["--log-level", "warning"]
        router_module = os.environ.get("TRIO_PD_DEMO_ROUTER_MODULE", "trio_pd")
        prefill_url = f"http://{HOST}:{self.prefill_port}"
        prefill = [
            py,
            "-m",
            "trio_pd_testing.engine",
            "--role",
            "prefill",
            "--port",
            str(self.prefill_port),
        ]
        prefill += ["--bootstrap-port", str(self.bootstrap_port), "--prefill-ms-per-token", "2"]
        prefill += ["--events", str(self.prefill_events), *common]
        decode = [
            py,
            "-m",
            "trio_pd_testing.engine",
            "--role",
            "decode",
            "--port",
            str(self.decode_port),
        ]
        decode += ["--events", str(self.decode_events), "--inter-token-ms", "10", *common]
        router = [
            py,
            "-m",
            router_module,
            "serve",
            "--prefill",
            prefill_url,
            str(self.bootstrap_port),
        ]
        router += ["--decode", f"http://{HOST}:{self.decode_port}"]
        router += ["--host", HOST, "--port", str(self.router_port)]
        router += ["--prometheus-host", HOST, "--prometheus-port", str(self.metrics_port)]
        if router_module == "trio_pd":  # another router need not have an admin listener
            router += ["--admin-port", str(self.admin_port)]
        return {"prefill": prefill, "decode": decode, "router": router}

    async def run(self) -> None:
        print("trio_pd demo: prefill + decode simulators behind the trio_pd router\n")
        urls = {
            "prefill": f"http://{HOST}:{self.prefill_port}",
            "decode": f"http://{HOST}:{self.decode_port}",
            "router": self.router,
        }
        with contextlib.ExitStack() as stack:
            async with (
                httpx2.AsyncClient(trust_env=False, timeout=30.0) as client,
                trio.open_nursery() as nursery,
            ):
                await self._run(stack, client, nursery, urls)

    async def _run(
        self,
        stack: contextlib.ExitStack,
        client: httpx2.AsyncClient,
        nursery: trio.Nursery,
        urls: dict[str, str],
    ) -> None:
        procs = {}
        for name, cmd in self.commands().items():
            log = stack.enter_context((self.workdir / f"{name}.log").open("wb"))
            run = partial(trio.run_process, cmd, check=False, stdout=log, stderr=log)
            procs[name] = await nursery.start(run)
        try:
            for name, url in urls.items():
                await wait_healthy(client, name, url, procs[name])
                line(f"{name} up", url)
        except (RuntimeError, trio.TooSlowError) as exc:
            print(f"\n  startup failed: {exc or 'timeout'}; logs in {self.workdir}")
            for name in urls:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-800:]
                if tail.strip():
                    print(f"\n--- {name}.log (tail) ---\n{tail}")
            nursery.cancel_scope.cancel()
            self.failed = True
            return
        print()
        await self.normal(client)
        await self.streaming(client)
        await self.prefill_failure(client)
        await self.vllm_pair(stack, client, nursery)
        print("\nstopping all processes")
        if self.unexpected:
            print("the demo did NOT show what it promises: " + "; ".join(self.unexpected))
        nursery.cancel_scope.cancel()

    async def normal(self, client: httpx2.AsyncClient) -> None:
        print("1. a normal /generate request")
        body = {"text": "Hello from the trio_pd demo", "sampling_params": {"max_new_tokens": 8}}
        start = time.perf_counter()
        r = await client.post(self.router + "/generate", json=body)
        line("status", r.status_code)
        line("text", r.json().get("text") if r.status_code == 200 else r.text[:200])
        line("latency", f"{(time.perf_counter() - start) * 1000:.1f} ms")
        self.expect(r.status_code == 200, f"a normal request answered {r.status_code}")

    async def streaming(self, client: httpx2.AsyncClient) -> None:
        print("\n2. a streaming /generate request")
        body = {"text": "stream me", "stream": True, "sampling_params": {"max_new_tokens": 8}}
        start = time.perf_counter()
        first: float | None = None
        events = 0
        async with client.stream("POST", self.router + "/generate", json=body) as r:
            line("status", f"{r.status_code} ({r.headers.get('content-type')})")
            async for raw in r.aiter_lines():
                if raw.startswith("data:"):
                    events += 1
                    if first is None:
                        first = time.perf_counter() - start
        line("events (incl. [DONE])", events)
        self.expect(r.status_code == 200 and events > 1, f"the stream gave {events} events")
        line("first event after", f"{first * 1000:.1f} ms" if first is not None else "-")
        line("total", f"{(time.perf_counter() - start) * 1000:.1f} ms")

    async def prefill_failure(self, client: httpx2.AsyncClient) -> None:
        print('\n3. a request whose prefill fails ("sim_fault": "prefill:500")')
        rid = f"demo-prefill-fails-{os.getpid()}"
        body = {"text": "this prefill will fail", "sim_fault": "prefill:500"}
        start = time.perf_counter()
        r = await client.post(self.router + "/generate", json=body, headers={"x-request-id": rid})
        line("client status", r.status_code)
        line("client body", r.text[:160])
        line("latency", f"{(time.perf_counter() - start) * 1000:.1f} ms")
        fault = await wait_for_event(self.prefill_events, 5.0, event="fault", rid=rid)
        closed = await wait_for_event(self.decode_events, 5.0, event="connection_closed", rid=rid)
        freed = await wait_for_event(self.decode_events, 5.0, event="slot_freed", rid=rid)
        self.expect(r.status_code == 502, f"a failing prefill answered {r.status_code}, not 502")
        self.expect(closed is not None and freed is not None, "the decode was not freed in 5 s")
        if fault is None:
            line("prefill fault", "not found in the prefill event log")
            return
        attempts = sum(
            1 for r in read_events(self.prefill_events) if r["event"] == "fault" and r["rid"] == rid
        )
        line("attempts that hit the fault", f"{attempts} (the router retries a 5xx prefill)")
        line("decode events (from its log)", "first attempt")
        if closed is not None:
            ms = (closed["t"] - fault["t"]) * 1000
            line("  prefill failure -> decode closed", f"{ms:8.1f} ms  (connection_closed)")
        else:
            line("  decode connection_closed", "not seen (the router kept decode waiting)")
        if freed is not None:
            ms = (freed["t"] - fault["t"]) * 1000
            line("  prefill failure -> slot freed", f"{ms:8.1f} ms  (reason: {freed['reason']})")
            if freed["reason"] == "aborted_request":
                line("", "(freed by the router's /abort_request, before the engine's 1 s poll)")
            else:
                line("", "(freed at the engine's 1 s disconnect-poll tick)")
        else:
            line("  decode slot_freed", "not within 5 s (the slot is still held)")

    # -- a vLLM pair (docs/vllm.md) -------------------------------------------------------------

    async def vllm_pair(
        self, stack: contextlib.ExitStack, client: httpx2.AsyncClient, nursery: trio.Nursery
    ) -> None:
        """The same containment on a vLLM pair: the simulator's vLLM mode behind a second
        router started with --vllm-pd-disaggregation; the prefill's KV blocks are watched."""
        print("\n4. a vLLM pair (NixlConnector pull: prefill first, then decode with its params)")
        py = sys.executable
        ports = {name: free_port() for name in ("vllm-prefill", "vllm-decode", "vllm-router")}
        engine = [py, "-m", "trio_pd_testing.engine.vllm", "--host", HOST]
        prefill = f"http://{HOST}:{ports['vllm-prefill']}"
        decode = f"http://{HOST}:{ports['vllm-decode']}"
        router = f"http://{HOST}:{ports['vllm-router']}"
        commands = {
            "vllm-prefill": [*engine, "--port", str(ports["vllm-prefill"]), "--role", "prefill",
                             "--prefill-ms-per-token", "2"],
            "vllm-decode": [*engine, "--port", str(ports["vllm-decode"]), "--role", "decode",
                            "--inter-token-ms", "10"],
            "vllm-router": [py, "-m", "trio_pd", "serve", "--vllm-pd-disaggregation",
                            "--prefill", prefill, "--decode", decode, "--host", HOST,
                            "--port", str(ports["vllm-router"]), "--log-level", "warning",
                            "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
                            "--admin-port", str(free_port())],
        }  # fmt: skip
        urls = {"vllm-prefill": prefill, "vllm-decode": decode, "vllm-router": router}
        for name, cmd in commands.items():
            log = stack.enter_context((self.workdir / f"{name}.log").open("wb"))
            run = partial(trio.run_process, cmd, check=False, stdout=log, stderr=log)
            proc = await nursery.start(run)
            try:
                await wait_healthy(client, name, urls[name], proc)
            except (RuntimeError, trio.TooSlowError) as exc:
                print(f"  {name} did not start: {exc or 'timeout'}; logs in {self.workdir}")
                self.failed = True
                return
            line(f"{name} up", urls[name])

        async def blocks() -> dict[str, Any]:
            return (await client.get(prefill + "/sim/kv_blocks")).json()

        body = {"model": "sim-model", "prompt": "Hello from a vLLM pair", "max_tokens": 8}
        r = await client.post(router + "/v1/completions", json=body)
        line("status", r.status_code)
        answer = r.json() if r.status_code == 200 else {}
        line("text", answer.get("choices", [{}])[0].get("text", r.text[:120]))
        line("kv_transfer_params in the answer", "kv_transfer_params" in answer)
        self.expect(r.status_code == 200, f"the vLLM pair answered {r.status_code}")
        self.expect("kv_transfer_params" not in answer, "the handoff reached the client")
        after = await blocks()
        line("prefill blocks held / freed by read", f"{after['held_blocks']} / "
             f"{after['freed']['read']}  (the decode read the handoff)")  # fmt: skip

        print('\n5. a vLLM prefill that fails ("sim_fault": "prefill:status:500")')
        start = time.perf_counter()
        failing = {**body, "sim_fault": "prefill:status:500"}
        r = await client.post(router + "/v1/completions", json=failing)
        line("client status", r.status_code)
        line("client body", r.text[:160])
        line("latency", f"{(time.perf_counter() - start) * 1000:.1f} ms")
        after = await blocks()
        line("prefill blocks held after it", f"{after['held_blocks']}  (nothing leaked)")
        self.expect(r.status_code == 502, f"a failing vLLM prefill answered {r.status_code}")
        self.expect(after["held_blocks"] == 0, "the failing vLLM prefill left blocks held")

        print("\n6. a client that leaves while the vLLM prefill computes")
        slow = {**body, "prompt": " ".join(["word"] * 400)}  # 400 tokens at 2 ms: 0.8 s
        with trio.move_on_after(0.3):
            await client.post(router + "/v1/completions", json=slow)
        with trio.move_on_after(3):
            while (await blocks())["freed"]["aborted"] < 1:  # noqa: ASYNC110 - another process
                await trio.sleep(0.05)
        after = await blocks()
        line("prefill blocks freed (connection closed)", f"{after['freed']['aborted']}  "
             f"held now: {after['held_blocks']}")  # fmt: skip
        self.expect(after["freed"]["aborted"] >= 1, "the left prefill's blocks were not freed")


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="trio-pd-demo-") as tmp:
        demo = Demo(Path(tmp))
        interrupted = False
        try:
            trio.run(demo.run)
        except* KeyboardInterrupt:
            interrupted = True
    if interrupted:
        print("\ninterrupted; all processes stopped")
        raise SystemExit(130)
    if demo.failed:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
