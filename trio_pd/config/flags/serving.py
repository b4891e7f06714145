"""The table's rows for serving: listeners, processes, limits, admission, keys, TLS, logs,
metrics, tracing and the request's timeouts (one row a flag: `flag.py` says what a row holds)."""

from __future__ import annotations

from trio_pd.config.flags.flag import SWITCH, Flag
from trio_pd.config.keys import parse_keys
from trio_pd.config.values import admin_port, check_origins, comma_list, duration_buckets

LOG_LEVELS = ("debug", "info", "warn", "error", "warning", "critical")  # SGLang's four first

SERVING: tuple[Flag, ...] = (
    Flag("--host", "address to listen on (IPv4 or IPv6)", "host", default="0.0.0.0"),
    Flag("--port", "port to listen on", "port", default=30000, type=int),
    Flag(
        "--admin-host",
        "address of the admin listener, the control plane's own door (keep it loopback: without "
        "control-plane keys, whoever reaches it may change membership)",
        "admin_host",
        default="127.0.0.1",
    ),
    Flag(
        "--admin-port",
        "port of the admin listener (plain HTTP): the control routes, probes and metrics; "
        "without control-plane keys, the only place worker membership and cache flushes are "
        "served. 0: any free port; none: no admin listener",
        "admin_port",
        default=29001,  # beside SMG's metrics port; RouterConfig's own default is no listener
        type=admin_port,
        metavar="PORT|none",
    ),
    Flag(
        "--workers",
        "router processes sharing the port (SO_REUSEPORT), the membership and the metrics",
        "workers",
        default=1,
        type=int,
    ),
    Flag(
        "--request-timeout-secs",
        "a request's whole time, all attempts included (504 after it)",
        "request_timeout_secs",
        default=1800.0,
        type=float,
    ),
    Flag(
        "--max-payload-size",
        "largest request body in bytes (413 beyond)",
        "max_payload_size",
        default=536_870_912,
        type=int,
    ),
    Flag(
        "--max-buffered-bytes",
        "memory for request bodies (their parse included) and buffered answers, all requests "
        "together (with --workers N, divided among them): 429 beyond, 413 for a request that "
        "could never fit; 0: no budget",
        "max_buffered_bytes",
        default=2 << 30,
        type=int,
    ),
    Flag(
        "--max-sse-event-bytes",
        "largest SSE event the router buffers from a worker (decode's first, each of "
        "prefill's; later decode events are relayed unbuffered): a larger one fails that leg as "
        "the worker's fault (502)",
        "max_sse_event_bytes",
        default=16 << 20,
        type=int,
    ),
    Flag(
        "--max-batch-size",
        "longest batch (text/input_ids/prompt lists) and largest n a request may carry",
        "max_batch_size",
        default=1024,
        type=int,
    ),
    Flag(
        "--max-concurrent-requests",
        "requests in flight at most, streams until their last event; -1: no limit (with "
        "--workers N, divided among them)",
        "max_concurrent_requests",
        default=-1,
        type=int,
        differs="a cap that always holds, as SGLang documents it: SMG 0.3.2 admits on a token "
        "bucket whose refill lets more in every second while earlier requests still run",
    ),
    Flag(
        "--queue-size",
        "requests waiting for a slot beyond --max-concurrent-requests (0: 429 at once)",
        "queue_size",
        default=100,
        type=int,
    ),
    Flag(
        "--queue-timeout-secs",
        "longest wait in that queue (then 408, as SGLang's router answers)",
        "queue_timeout_secs",
        default=60.0,
        type=float,
    ),
    Flag(
        "--rate-limit-tokens-per-second",
        "with --max-concurrent-requests N: admit at most this many requests a second after a "
        "burst of N (a token bucket); none or 0: no rate limit, the cap alone",
        "rate_limit_tokens_per_second",
        type=int,
        differs="a rate limit beside the cap (a spent token is not given back); without it or "
        "with 0, the cap alone. SMG 0.3.2 gives tokens back and refills at this rate (default "
        "N), which only loosens its cap",
    ),
    Flag(
        "--request-id-headers",
        "headers a client's request id is taken from, first present wins (default: x-request-id "
        "x-correlation-id x-trace-id request-id; none listed: always generate)",
        "request_id_headers",
        nargs="*",
        metavar="HEADER",
        convert=lambda v: None if v is None else tuple(v),
    ),
    Flag(
        "--cors-allowed-origins",
        "origins browsers may call the router from (default: any origin)",
        "cors_allowed_origins",
        default=[],
        nargs="*",
        metavar="ORIGIN",
        convert=check_origins,
    ),
    Flag(
        "--no-abort-on-cancel",
        "do not POST /abort_request to engines for legs the router cancels (for engines "
        "without that endpoint)",
        "abort_on_cancel",
        action=SWITCH,
        invert=True,
    ),
    Flag(
        "--api-key",
        "sent to workers as `Authorization: Bearer`, and required of clients on the generation "
        "routes (and the control plane without control-plane keys), as in SGLang's router; also "
        "read from $TRIO_PD_API_KEY",
        "api_key",
        env="TRIO_PD_API_KEY",
        differs="`--data-plane-api-keys` adds more client keys beside it; from the flag or "
        "`$TRIO_PD_API_KEY`, it must be visible ASCII",
    ),
    Flag(
        "--worker-admin-api-key",
        "sent on the workers' POST /abort_request (engines started with --admin-api-key take "
        "only that key there); default: the worker's --api-key. Also read from "
        "$TRIO_PD_WORKER_ADMIN_API_KEY; a worker's own admin_api_key (admin API, membership "
        "file) wins",
        "worker_admin_api_key",
        env="TRIO_PD_WORKER_ADMIN_API_KEY",
    ),
    Flag(
        "--control-plane-api-keys",
        "keys of the router's control plane; role admin may change, user may read. One entry "
        "per argument, or a list joined by , or ; (cut only where the next id:name:role: "
        "starts, so a key may hold , and ;)",
        "control_plane_api_keys",
        default=[],
        nargs="*",
        metavar="ID:NAME:ROLE:KEY",
        convert=parse_keys,
        differs="without them and without `--api-key`, the changing routes are served on the "
        "admin listener only (`--admin-port`), never on this port (SGLang's are open to anyone "
        "who reaches the port); with keys they are needed on both; a key must be visible ASCII",
    ),
    Flag(
        "--control-plane-audit-enabled",
        "log every control-plane change with the key id that made it",
        "control_plane_audit_enabled",
        action=SWITCH,
    ),
    Flag(
        "--data-plane-api-keys",
        "more keys clients may present on the generation routes, beside --api-key (also "
        "$TRIO_PD_DATA_PLANE_API_KEYS, comma-separated)",
        "data_plane_api_keys",
        default=[],
        nargs="+",
        metavar="KEY",
        env="TRIO_PD_DATA_PLANE_API_KEYS",
        convert=lambda v: comma_list(v) if isinstance(v, str) else tuple(v),
    ),
    Flag(
        "--worker-url-allow",
        "let workers point into these refused ranges anyway (link-local, metadata...)",
        "worker_url_allow",
        default=[],
        nargs="+",
        metavar="CIDR",
        convert=tuple,
    ),
    Flag(
        "--ca-cert-paths",
        "CA certificates for https workers (added to the system store)",
        "ca_cert_paths",
        default=[],
        nargs="*",
        metavar="FILE",
        convert=tuple,
    ),
    Flag("--client-cert-path", "client certificate (mTLS to workers)", "client_cert_path"),
    Flag("--client-key-path", "the key of --client-cert-path", "client_key_path"),
    Flag(
        "--access-log",
        "one log line per request (id, route, status...)",
        "access_log",
        action=SWITCH,
    ),
    Flag("--log-json", "log as JSON lines", "log_json", action=SWITCH),
    Flag(
        "--log-level",
        "debug, info, warn, error (SGLang's spellings)",
        "log_level",
        default="info",
        choices=LOG_LEVELS,
        differs="`warning` and `critical` (Python's names) are accepted too",
    ),
    Flag(
        "--log-dir",
        "also write logs to files in this directory, one per UTC day (trio-pd.YYYY-MM-DD; "
        "every process of --workers N appends to it)",
        "log_dir",
        differs="a directory that cannot be created or written stops the start-up with the "
        "reason (SGLang's router then logs nowhere): logs asked for must not be lost silently",
    ),
    Flag(
        "--prometheus-port",
        "serve /metrics, and only that, on this port (plain HTTP)",
        "prometheus_port",
        default=29000,  # SMG's; RouterConfig's own default is no listener
        type=int,
        differs="`0` takes any free port; a taken port stops the start-up with the reason, as "
        "SGLang's router does by panicking",
    ),
    Flag(
        "--prometheus-host",
        "the address of the --prometheus-port listener (IPv4 or IPv6)",
        "prometheus_host",
        default="0.0.0.0",
    ),
    Flag(
        "--prometheus-duration-buckets",
        "buckets of the *_duration_seconds histograms (default: trio_pd's own)",
        "prometheus_duration_buckets",
        type=float,
        nargs="+",
        metavar="SECONDS",
        convert=duration_buckets,
    ),
    Flag(
        "--first-token-timeout-secs",
        "streams: decode's first event must come within this",
        "timeouts.first_token_secs",
        default=60.0,
        type=float,
    ),
    Flag(
        "--stream-idle-timeout-secs",
        "streams: the longest silence of decode once it started",
        "timeouts.stream_idle_secs",
        default=120.0,
        type=float,
    ),
    Flag(
        "--prefill-hold-timeout-secs",
        "how long prefill may still run once decode has answered",
        "timeouts.prefill_hold_secs",
        default=30.0,
        type=float,
    ),
    Flag(
        "--client-body-timeout-secs",
        "the client's whole request body must arrive within this (else 408)",
        "timeouts.client_body_secs",
        default=60.0,
        type=float,
    ),
    Flag(
        "--stream-stall-timeout-secs",
        "a client that has not read its stream for this long is cut off",
        "timeouts.stream_stall_secs",
        default=30.0,
        type=float,
    ),
    Flag(
        "--shutdown-grace-period-secs",
        "on SIGTERM, how long requests in flight may still run",
        "shutdown_grace_period_secs",
        default=180.0,
        type=float,
    ),
    Flag("--tls-cert-path", "serve HTTPS with this certificate", "tls_cert_path"),
    Flag("--tls-key-path", "the key of --tls-cert-path", "tls_key_path"),
    Flag(
        "--tls-handshake-timeout-secs",
        "with --tls-cert-path: a client's TLS handshake must end within this, else the "
        "connection is closed",
        "tls_handshake_timeout_secs",
        default=10.0,
        type=float,
    ),
    Flag(
        "--enable-http2",
        "also serve HTTP/2 (h2c upgrade, prior knowledge, ALPN h2 over TLS) with hypercorn's "
        "limits: 100 streams at once and 1000 requests per connection; off, the router speaks "
        "HTTP/1.1 only",
        "enable_http2",
        action=SWITCH,
    ),
    Flag(
        "--enable-trace",
        "Enable opentelemetry trace: a span per request, attempt and leg, exported over "
        "OTLP/gRPC; each worker gets its leg's traceparent (needs pip install 'trio_pd[trace]')",
        "enable_trace",
        action=SWITCH,
    ),
    Flag(
        "--otlp-traces-endpoint",
        "Config opentelemetry collector endpoint if --enable-trace is set. format: <ip>:<port> "
        "(OTLP over gRPC; http:// or https:// may lead)",
        "otlp_traces_endpoint",
        default="localhost:4317",
    ),
)
