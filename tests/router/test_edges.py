"""The edges of a connection, through a real router over real sockets (issue 21, SMG 1.13):
the SSE keep-alive, the client connections' header and idle timeouts, the upstream pool's idle
timeout and the probe listener. Timing runs on trio's MockClock (autojump): the engines, the
router and the clients share the run, so a wait of seconds takes none."""

from __future__ import annotations

import attrs
import pytest
import trio

from tests.cluster import Cluster, start_cluster
from tests.conftest import cluster_of
from tests.router.helpers import CANCELLED, generate_body
from tests.router.hostile import SSE_HEAD, Posted, answer_ok, chunk, start_hostile
from trio_pd.cli.main import build_parser, router_config
from trio_pd.config import EdgeConfig, RouterConfig

PING = b": ping\n\n"
HEALTH = b"GET /health HTTP/1.1\r\nhost: router\r\n\r\n"
SLOW_PREFILL = {"prefill_ms_per_token": 400.0}  # the body's ~10 tokens: a prefill of ~4 s


def edges(**values: object) -> EdgeConfig:
    return attrs.evolve(RouterConfig().edges, **values)


async def stream_raw(cluster: Cluster, body: dict[str, object]) -> tuple[int, list[bytes], str]:
    """The status, every body chunk as it came (with the mock time it came at, in order) and
    the request id of a streamed /generate."""
    chunks: list[bytes] = []
    async with cluster.client.stream("POST", "/generate", json=body) as response:
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
        return response.status_code, chunks, response.headers["x-request-id"]


# -- the SSE keep-alive ------------------------------------------------------------------------


async def test_a_slow_prefill_gets_keepalive_comments_before_the_first_event(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cluster = await start_cluster(nursery, prefill=SLOW_PREFILL, edges=edges(sse_keepalive_secs=1))
    started = trio.current_time()
    status, chunks, rid = await stream_raw(cluster, generate_body(stream=True))
    body = b"".join(chunks)
    assert status == 200
    before_first_event = body[: body.index(b"data:")]
    assert before_first_event.count(PING) >= 3  # ~4 s of prefill, a comment a second
    assert before_first_event == PING * before_first_event.count(PING)  # nothing else
    assert body.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in body
    # The engines served it once, whole: the comments changed nothing upstream.
    assert len(cluster.prefill.events.find("request_start", rid=rid)) == 1
    assert len(cluster.decode.events.find("request_start", rid=rid)) == 1
    assert trio.current_time() - started >= 3


async def test_no_keepalive_while_events_flow_and_none_when_off(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Fast events carry no comment; 0 sends none even over a slow prefill."""
    fast = await start_cluster(nursery, edges=edges(sse_keepalive_secs=1))
    _, chunks, _ = await stream_raw(fast, generate_body(stream=True, max_new_tokens=8))
    assert PING not in b"".join(chunks)
    off = await start_cluster(nursery, prefill=SLOW_PREFILL, edges=edges(sse_keepalive_secs=0))
    status, chunks, _ = await stream_raw(off, generate_body(stream=True))
    assert status == 200
    assert PING not in b"".join(chunks)
    assert b"".join(chunks).startswith(b"data:")


async def test_a_silent_decode_mid_stream_gets_comments_between_events(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cluster = await start_cluster(
        nursery, decode={"inter_token_ms": 2500.0}, edges=edges(sse_keepalive_secs=1)
    )
    _, chunks, _ = await stream_raw(cluster, generate_body(stream=True, max_new_tokens=4))
    body = b"".join(chunks)
    events = [e for e in body.split(b"\n\n") if e]
    data_at = [i for i, e in enumerate(events) if e.startswith(b"data:")]
    between = events[data_at[0] : data_at[-1]]
    assert between.count(PING.strip(b"\n")) >= 3  # 2.5 s gaps, a comment a second in each
    # Every comment sits between whole events: the stream still parses event by event.
    assert all(e.startswith((b"data:", b": ping")) for e in events)


async def test_a_prefill_failing_after_the_first_keepalive_is_an_inband_error(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """The headers went out with the first comment: the prefill's 500 (3 s in) cannot be the
    client's status any more, so it is an error event, then [DONE]; decode is still cancelled
    at once (the heart of PD), and nothing of the engines' answer reached the client."""
    cluster = await start_cluster(nursery, edges=edges(sse_keepalive_secs=1))
    body = generate_body(stream=True, sim_fault="prefill:500@3000")
    status, chunks, rid = await stream_raw(cluster, body)
    raw = b"".join(chunks)
    assert status == 200
    assert raw.startswith(PING)
    frames = [e for e in raw.split(b"\n\n") if e.startswith(b"data:")]
    assert frames[-1] == b"data: [DONE]"
    assert b'"error"' in frames[0] and b"prefill" in frames[0]
    assert len(frames) == 2
    freed = await cluster.decode.events.wait_for("slot_freed", timeout=5, rid=rid)
    assert freed["reason"] in CANCELLED
    assert not cluster.decode.events.find("kv_ready", rid=rid)


async def test_a_prefill_failing_before_any_keepalive_keeps_its_status(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cluster = await start_cluster(nursery, edges=edges(sse_keepalive_secs=5))
    body = generate_body(stream=True, sim_fault="prefill:500@1000")
    response = await cluster.client.post("/generate", json=body)
    assert response.status_code == 502
    assert response.headers["content-type"] == "application/json"


# -- client connections: header and idle timeouts -----------------------------------------------


async def open_raw(cluster: Cluster) -> trio.SocketStream:
    host, port = cluster.url.removeprefix("http://").rsplit(":", 1)
    return await trio.open_tcp_stream(host, int(port))


async def get_health(stream: trio.SocketStream, head: bytes = HEALTH) -> bytes:
    await stream.send_all(head)
    answer = b""
    while b'"alive"' not in answer:
        chunk = await stream.receive_some(65536)
        if not chunk:
            break
        answer += chunk
    return answer


async def closed_by_peer(stream: trio.SocketStream) -> bool:
    try:
        return await stream.receive_some(65536) == b""
    except trio.BrokenResourceError:
        return True


async def test_an_idle_keepalive_connection_lives_past_5s_with_the_default(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """SMG's 90 s: a connection idle 6 s (beyond the old fixed 5 s) still carries a request."""
    cluster = await start_cluster(nursery)
    stream = await open_raw(cluster)
    assert b"HTTP/1.1 200 " in await get_health(stream)
    await trio.sleep(6)
    assert b"HTTP/1.1 200 " in await get_health(stream)
    await stream.aclose()


async def test_an_idle_connection_is_closed_after_the_idle_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cluster = await start_cluster(nursery, edges=edges(idle_connection_timeout_secs=8))
    stream = await open_raw(cluster)
    assert b"HTTP/1.1 200 " in await get_health(stream)
    answered_at = trio.current_time()
    assert await closed_by_peer(stream)
    assert 8 <= trio.current_time() - answered_at < 9


async def trickle_head(stream: trio.SocketStream, seconds: int) -> None:
    """A slowloris head: one header line a second, never the blank line ending it."""
    await stream.send_all(b"GET /health HTTP/1.1\r\nhost: router\r\n")
    for i in range(seconds):
        await trio.sleep(1)
        await stream.send_all(b"x-slow-%d: 1\r\n" % i)


async def test_a_slowloris_head_is_closed_after_the_header_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cluster = await start_cluster(nursery, edges=edges(header_read_timeout_secs=3))
    stream = await open_raw(cluster)
    opened = trio.current_time()
    async with trio.open_nursery() as sending:
        sending.start_soon(trickle_head, stream, 20)
        assert await closed_by_peer(stream)
        sending.cancel_scope.cancel()
    assert 3 <= trio.current_time() - opened < 4


async def test_a_slow_head_within_the_header_timeout_is_served(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """Bytes flowing do not extend the bound, but a head done within it is answered (the old
    fixed 5 s cut this one at 5 s)."""
    cluster = await start_cluster(nursery, edges=edges(header_read_timeout_secs=12))
    stream = await open_raw(cluster)
    await trickle_head(stream, 8)
    assert b"HTTP/1.1 200 " in await get_health(stream, b"\r\n")  # the trickled head's end
    await stream.aclose()


async def test_the_next_head_on_a_keepalive_connection_has_the_header_timeout(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cluster = await start_cluster(
        nursery, edges=edges(header_read_timeout_secs=3, idle_connection_timeout_secs=60)
    )
    stream = await open_raw(cluster)
    assert b"HTTP/1.1 200 " in await get_health(stream)
    await trio.sleep(10)  # idle, well within 60 s
    started = trio.current_time()
    async with trio.open_nursery() as sending:
        sending.start_soon(trickle_head, stream, 20)
        assert await closed_by_peer(stream)
        sending.cancel_scope.cancel()
    assert 3 <= trio.current_time() - started < 4


# -- the upstream pool's idle timeout -------------------------------------------------------------


async def test_an_upstream_connection_idle_past_the_pool_timeout_is_not_reused(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    cluster = await start_cluster(nursery, edges=edges(upstream_pool_idle_timeout_secs=1))
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    first = cluster.decode.total_connections
    assert cluster.upstream_connections(cluster.decode) == ["idle"]
    await trio.sleep(0.5)
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    assert cluster.decode.total_connections == first  # reused within the timeout
    await trio.sleep(1.5)
    assert cluster.upstream_connections(cluster.decode) == []  # pruned: closed, not kept
    await cluster.decode.wait_open_connections(0)  # the engine saw it closed
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    assert cluster.decode.total_connections == first + 1


async def test_the_default_pool_timeout_keeps_a_connection_for_2_5s(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """SMG's 3 s (the old fixed expiry was 2 s): a connection idle 2.5 s is reused."""
    cluster = await start_cluster(nursery)
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    first = cluster.decode.total_connections
    await trio.sleep(2.5)
    assert (await cluster.client.post("/generate", json=generate_body())).status_code == 200
    assert cluster.decode.total_connections == first


# -- the probe listener ---------------------------------------------------------------------------


def close_waits(port: int) -> int:
    """The router's sockets on `port` the client closed and the router has not (CLOSE_WAIT)."""
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "08" and int(fields[1].rpartition(":")[2], 16) == port:
                    count += 1
    return count


async def test_a_client_closing_an_idle_connection_is_closed_at_once(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """With a 90 s idle timeout, a closed client socket must not sit in CLOSE_WAIT for 90 s
    (hypercorn's idle timer held it until it ran out)."""
    cluster = await start_cluster(nursery)
    port = int(cluster.url.rsplit(":", 1)[1])
    streams = [await open_raw(cluster) for _ in range(3)]
    for stream in streams:
        assert b"HTTP/1.1 200 " in await get_health(stream)
    for stream in streams:
        await stream.aclose()
    with trio.fail_after(5):
        while close_waits(port):
            await trio.sleep(0.1)
    assert close_waits(port) == 0


# -- the flags' refusals --------------------------------------------------------------------------

WORKERS = ["--prefill", "http://127.0.0.1:30001", "--decode", "http://127.0.0.1:30011"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--sse-keepalive-secs", "-1"], "--sse-keepalive-secs must be 0 (off) or more"),
        (["--header-read-timeout-secs", "-2"], "--header-read-timeout-secs must be 0"),
        (["--idle-connection-timeout-secs", "nan"], "--idle-connection-timeout-secs must be 0"),
        (["--upstream-pool-idle-timeout-secs", "-1"], "--upstream-pool-idle-timeout-secs must"),
        (["--health-check-port", "0"], "--health-check-port must be a port number (1-65535)"),
        (
            ["--health-check-port", "30000", "--port", "30000"],
            "30000 is also --port: give the probes their own",
        ),
        (["--health-check-port", "29001"], "29001 is also --admin-port"),
    ],
)
def test_bad_edge_values_are_refused_with_the_flag(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        router_config(build_parser().parse_args(["serve", *WORKERS, *argv]))
    assert said in capsys.readouterr().err


async def test_a_stream_of_n_samples_over_a_slow_prefill_is_kept_alive(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """`n > 1` (one PD request a sample, merged into one stream): the keep-alive is the merged
    stream's, every sample's events follow it and the stream ends once."""
    cluster = await start_cluster(nursery, prefill=SLOW_PREFILL, edges=edges(sse_keepalive_secs=1))
    chat = {"messages": [{"role": "user", "content": "say three things"}], "max_tokens": 4,
            "n": 2, "stream": True}  # fmt: skip
    async with cluster.client.stream("POST", "/v1/chat/completions", json=chat) as response:
        assert response.status_code == 200
        raw = b"".join([chunk async for chunk in response.aiter_raw()])
    assert raw.startswith(PING)
    frames = [e for e in raw.split(b"\n\n") if e.startswith(b"data:")]
    assert frames[-1] == b"data: [DONE]" and frames.count(b"data: [DONE]") == 1
    assert b'"error"' not in raw
    for index in (b'"index":0', b'"index":1'):  # both samples' choices came
        assert any(index in frame for frame in frames[:-1]), index


async def test_no_keepalive_is_written_inside_an_event(
    nursery: trio.Nursery, autojump_clock: trio.testing.MockClock
) -> None:
    """A decode that stops for 5 s in the middle of its second event (raw chunks are relayed as
    they come): the comment waits for the event's end, and the stream parses event by event."""

    async def decode(posted: Posted, stream: trio.SocketStream) -> None:
        await stream.send_all(SSE_HEAD + chunk(b'data: {"text": "a"}\n\n'))
        await stream.send_all(chunk(b'data: {"text": "a'))
        await trio.sleep(5)
        await stream.send_all(chunk(b'b"}\n\n'))
        await trio.sleep(3)  # silent between events: comments come here
        await stream.send_all(chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")

    p = await start_hostile(nursery, answer_ok)
    d = await start_hostile(nursery, decode)
    cluster = await cluster_of(nursery, [p], [d], edges=edges(sse_keepalive_secs=1))  # type: ignore[list-item]
    status, chunks, _ = await stream_raw(cluster, generate_body(stream=True))
    body = b"".join(chunks)
    assert status == 200
    assert b'data: {"text": "ab"}\n\n' in body  # the second event whole, no comment inside
    events = [e for e in body.split(b"\n\n") if e]
    assert events[:2] == [b'data: {"text": "a"}', b'data: {"text": "ab"}']
    assert events.count(b": ping") >= 2  # in the silence after it
    assert events[-1] == b"data: [DONE]"
