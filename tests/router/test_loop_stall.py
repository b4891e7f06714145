"""The router's event loop keeps turning while adversarial requests are in flight.

One router process relays everyone's tokens, so a request that costs seconds of CPU on the event
loop (parsing megabytes of tiny JSON values, building millions of bootstrap rooms for a huge
`n`) would freeze every stream it carries. What decides the test is the CPU time of the longest
single task step on the loop (a trio instrument reading `time.thread_time()` around each step,
garbage collections included): a step that parses 16 MB in one go costs its CPU time whether
the machine is idle or busy, while the wall-clock gap between a ticking task's wakeups also
counts the time the OS scheduler gave the CPU to other processes (on a busy 2-core machine,
279-648 ms stalls were seen while no step cost more than 164 ms). The wall-clock stall is
measured and printed beside it, never asserted (timing belongs in `bench/`). Three windows:

- calibration: a task burns 0.5 s of CPU in one step on the loop; the instrument must see it
  (>= 0.45 s of CPU), or it could not fail;
- baseline: normal requests only;
- adversarial: chat `n` of 2**64-1, 3e6 and 1e8 (refused 400 at once, no worker touched), a
  `/generate` text list of 10**6 items (refused 400), bodies of 1 to 16 MB of tiny JSON values
  (`{"messages": [{}, {}, ...]}`, `{"input_ids": [0, 1, ...]}`, passed on), and deeply nested
  JSON (refused 400), all at once.

The router runs in the test process, as everywhere in the suite, but here the two engines are
separate processes (`python -m trio_pd_testing.engine`): an in-process simulator parsing
the same 16 MB bodies on the same loop would be measured too. Their JSON-lines event logs say
which request reached them.
"""

from __future__ import annotations

import time
from pathlib import Path

import attrs
import orjson
import trio

from tests.router.helpers import generate_body
from tests.router.loop_tools import calibrated, external_engine, measured, routed

STEP_CPU_BOUND = 0.25  # CPU seconds in one step: "a few milliseconds, not seconds"
MB = 1 << 20


# -- the adversarial bodies --------------------------------------------------------------------


def tiny_values(key: bytes, item: bytes, size: int) -> bytes:
    count = size // (len(item) + 1)
    return b'{"' + key + b'":[' + b",".join([item] * count) + b"]}"


def counting_ids(size: int) -> bytes:
    """`{"input_ids": [0, 1, ..., 9, 0, 1, ...]}` of about `size` bytes."""
    digits = b",".join(str(i % 10).encode() for i in range(10))
    return b'{"input_ids":[' + b",".join([digits] * (size // 20)) + b"]}"


def chat_n(n: int) -> bytes:
    return orjson.dumps({"messages": [{"role": "user", "content": "hi"}], "n": n}, option=0)


@attrs.frozen
class Adversary:
    name: str
    path: str
    body: bytes
    status: int  # what the router must answer


def adversaries() -> list[Adversary]:
    chat, generate = "/v1/chat/completions", "/generate"
    nested = b'{"text":"x","a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    text_list = b'{"text":[' + b",".join([b'"a"'] * 1_000_000) + b"]}"
    return [
        Adversary("n-2**64-1", chat, b'{"messages":[{"role":"user","content":"hi"}],'
                  b'"n":18446744073709551615}', 400),
        Adversary("n-3e6", chat, chat_n(3_000_000), 400),
        Adversary("n-1e8", chat, chat_n(10**8), 400),
        Adversary("text-list-1e6", generate, text_list, 400),
        Adversary("nested-1e5", generate, nested, 400),
        Adversary("messages-1MB", chat, tiny_values(b"messages", b"{}", MB), 200),
        Adversary("messages-16MB", chat, tiny_values(b"messages", b"{}", 16 * MB), 200),
        Adversary("input_ids-4MB", generate, counting_ids(4 * MB), 200),
        Adversary("input_ids-16MB", generate, counting_ids(16 * MB), 200),
    ]  # fmt: skip


# -- the test ----------------------------------------------------------------------------------


async def test_event_loop_keeps_turning_under_adversarial_bodies(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    async with (
        external_engine(tmp_path, "prefill") as prefill,
        external_engine(tmp_path, "decode") as decode,
    ):
        # No memory budget: all these bodies at once would not fit the default one (some would
        # get 429, which test_memory shows); the loop's turning is what this test measures.
        _, client = await routed(nursery, prefill, decode, max_buffered_bytes=0)

        async def normal_requests() -> None:
            for _ in range(10):
                response = await client.post("/generate", json=generate_body())
                assert response.status_code == 200

        # 1. The instrument can fail: a step burning half a second of CPU is seen as one.
        calibration = await calibrated()

        # 2. Baseline: ordinary traffic.
        baseline = await measured(normal_requests)

        # 3. Adversarial bodies, all in flight at once, with ordinary traffic beside them.
        cases = adversaries()
        results: dict[str, tuple[int, float, bytes]] = {}

        async def send(case: Adversary) -> None:
            started = time.perf_counter()
            response = await client.post(
                case.path, content=case.body, headers={"x-request-id": f"stall-{case.name}"}
            )
            results[case.name] = (
                response.status_code,
                time.perf_counter() - started,
                response.content[:200],
            )

        async def adversarial() -> None:
            async with trio.open_nursery() as load:
                for case in cases:
                    load.start_soon(send, case)
                load.start_soon(normal_requests)

        attack = await measured(adversarial)
        print(f"\nloop stall: calibration {calibration}")
        print(f"loop stall: baseline    {baseline}")
        print(f"loop stall: adversarial {attack}")
        for case in cases:
            status, took, _ = results[case.name]
            print(f"  {case.name:16} {len(case.body) / MB:6.2f} MB -> {status} in {took:.2f}s")

        for case in cases:
            status, _, head = results[case.name]
            assert status == case.status, (case.name, status, head)
            rid = f"stall-{case.name}"
            if case.status == 400:
                assert orjson.loads(head)["error"]["type"] == "invalid_request_error"
                assert prefill.started(rid) == 0, case.name  # refused: no worker touched
                assert decode.started(rid) == 0, case.name
            else:
                assert prefill.started(rid) == 1, case.name  # passed on, to both legs
                assert decode.started(rid) == 1, case.name
        assert attack.step_cpu < STEP_CPU_BOUND, attack
        await client.aclose()
