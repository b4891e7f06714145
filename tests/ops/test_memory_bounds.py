"""The memory a real `trio-pd serve` takes for hostile bodies, measured from outside (issue 19,
item 3): the peak RSS of its process tree (the router and its parse workers), read from
/proc/<pid>/status (VmHWM: each process's high-water mark, so no sampling can miss a peak).

Bounds are loose (exact figures: bench/memory.py). On 7462f5a a 50 MB body of `[{},{},...]`
took 1.8 GB, and three 100 MB bodies with `--max-concurrent-requests 1 --queue-size 0` ~1.6 GB
(all read and parsed before admission refused two of them).
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import psutil
import trio

from tests.conftest import start_engine
from tests.ops.serve import ServeProcess, start_serve
from tests.router.test_memory import RawUpload

MB = 1 << 20


def high_water(pid: int) -> int:
    """VmHWM of one process, in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree(router: ServeProcess) -> list[int]:
    root = psutil.Process(router.process.pid)
    return [root.pid, *(child.pid for child in root.children(recursive=True))]


def tree_rss(router: ServeProcess) -> int:
    total = 0
    for pid in tree(router):
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            total += psutil.Process(pid).memory_info().rss
    return total


async def serve_with(nursery: trio.Nursery, tmp_path: Path, *flags: str) -> ServeProcess:
    prefill = await start_engine(nursery, "prefill")
    decode = await start_engine(nursery, "decode")
    router = await start_serve([prefill], [decode], str(tmp_path / "router.log"), *flags)
    await router.wait_ready()
    return router


async def test_a_body_of_tiny_json_values_is_refused_before_its_parse_grows(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    router = await serve_with(nursery, tmp_path)
    try:
        before = tree_rss(router)
        body = b'{"text":"x","a":[' + b"{}," * (50 * MB // 3) + b"{}]}"
        upload = RawUpload(router.url, body, "empties")
        await upload.run()
        assert upload.status == 413
        peak = sum(high_water(pid) for pid in tree(router))
        # The body is read (50 MB, plus its join) and priced; its 16.7 million dicts are not
        # built (they took 1.2 GB in the parse worker on 7462f5a).
        assert peak - before < 400 * MB, (before, peak)
    finally:
        await router.stop()


async def test_bodies_refused_by_admission_are_never_held(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    router = await serve_with(
        nursery, tmp_path, "--max-concurrent-requests", "1", "--queue-size", "0"
    )
    try:
        before = tree_rss(router)
        body = b'{"text":"' + b"a" * (100 * MB) + b'"}'
        uploads = [RawUpload(router.url, body, f"big-{i}") for i in range(3)]
        async with trio.open_nursery() as clients:
            for upload in uploads:
                clients.start_soon(upload.run)
        statuses = sorted(upload.status for upload in uploads)
        # One admitted (the engines refuse 100 MB: 413), two refused by admission unread.
        assert statuses.count(429) >= 1, statuses
        peak = sum(high_water(pid) for pid in tree(router))
        # One body at a time: ~2x in the router (its bytes, the legs' copy) and ~3x in the parse
        # worker (its copies and the string it becomes); three at once took ~15x on 7462f5a.
        assert peak - before < 900 * MB, (before, peak)
    finally:
        await router.stop()
