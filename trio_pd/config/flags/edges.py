"""The table's rows for the edges of a connection, in SMG 1.13's names, meanings and defaults:
the SSE keep-alive, the client connections' header and idle timeouts, the upstream pool's idle
timeout and the dedicated probe listener; and trio_pd's own cap on client connections (one row
a flag: `flag.py` says what a row holds)."""

from __future__ import annotations

from trio_pd.config.flags.flag import Flag

EDGES: tuple[Flag, ...] = (
    Flag(
        "--sse-keepalive-secs",
        "seconds of silence after which an open SSE stream carries a keep-alive comment "
        "(`: ping`), so an idle-timeout proxy does not cut a stream waiting on a long prefill; "
        "nothing is sent while events flow. The headers wait for decode's first event (a "
        "failed prefill gets its real status) until the first keep-alive sends them; a failure "
        "after it is an in-band error event. 0 sends none",
        "edges.sse_keepalive_secs",
        default=15.0,
        type=float,
    ),
    Flag(
        "--header-read-timeout-secs",
        "close a connection that has not sent a complete request head within this many seconds "
        "of being accepted (and a keep-alive connection whose next request head stalls this "
        "long after its first byte). 0 disables",
        "edges.header_read_timeout_secs",
        default=30.0,
        type=float,
    ),
    Flag(
        "--idle-connection-timeout-secs",
        "close a client keep-alive connection that has had no request in flight for this many "
        "seconds (keep it above the idle timeout of a proxy or load balancer in front); 0 keeps "
        "idle connections until the client closes them",
        "edges.idle_connection_timeout_secs",
        default=90.0,
        type=float,
    ),
    Flag(
        "--upstream-pool-idle-timeout-secs",
        "an idle pooled connection to a worker is closed, not reused, once idle this long; keep "
        "it below the engines' own keep-alive (5 s for SGLang and vLLM). 0 keeps idle "
        "connections forever",
        "edges.upstream_pool_idle_timeout_secs",
        default=3.0,
        type=float,
    ),
    Flag(
        "--health-check-port",
        "a dedicated listener (plain HTTP, on --host) for the probes only: /health, /liveness, "
        "/readiness, /ready, served apart from the data plane's connections so probes are not "
        "starved by requests (the probes stay on the main port too); unset: none",
        "edges.health_check_port",
        type=int,
    ),
    Flag(
        "--max-client-connections",
        "client connections each router process keeps open at once on the data port; one "
        "more is answered 503 and closed at once (counted in "
        "trio_pd_client_connections_refused_total), so idle connections cannot take the file "
        "descriptors the probe and admin listeners and the workers' connections need. 0: "
        "derived from the process's file-descriptor limit (raised to its hard limit at start): "
        "(limit - 256) / 3",
        "edges.max_client_connections",
        default=0,
        type=int,
    ),
)
