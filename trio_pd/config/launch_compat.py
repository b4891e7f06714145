"""SMG 1.13.0's `smg launch` flags that `trio-pd serve` does not have: ignored or refused.

`trio-pd launch` takes every flag of `smg launch` (SMG 1.13.0, SGLang's router today). The ones
`serve` has mean there what they mean in SMG, through the same row (`config/flags/launch.py`
says where 1.13 changed a meaning or a default); the ones here are SMG services a PD router does
not offer, parsed with SMG's arity, and follow `config/compat.py`'s rule:

- **ignored with a warning** naming the flag where ignoring it cannot change where a request
  goes or who may send it: tokenizer and parser settings, history stores, WASM hooks, the RL
  control plane, the mesh, gRPC/ZMQ and multimodal transport, the tuning knobs of SMG's own
  cache-aware index and worker monitor;
- **refused** (exit 2, the reason) where it would: EPD (encode workers), HTTP/2 to the workers,
  per-tenant data-plane keys, tenant rate limits and the priority scheduler.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import attrs

from trio_pd.config import compat
from trio_pd.config.build import build_config
from trio_pd.config.checks import ConfigError
from trio_pd.config.compat import NOT_SERVED, Foreign
from trio_pd.config.flags import BY_NAME
from trio_pd.config.flags.launch import LAUNCH_FLAGS, WIDER_CHOICES
from trio_pd.config.router import RouterConfig

# Flags whose serve row is being added on another branch: the serve row of the same name.
UPSTREAM_HTTP2 = (
    "trio_pd's upstream is its own HTTP/1.1 keep-alive pool (trio_pd/upstream/http11.py) and "
    "h2c to the workers is not supported: a Python h2c client (the h2 library) spent 5.7-6.5x "
    "its CPU per call on a JSON answer and 24-30x on a 64-event stream (bench/upstream_http2.py); "
    "drop the flag, every worker speaks HTTP/1.1"
)
EPD = (
    "EPD (encode/prefill/decode) disaggregation is not supported: trio_pd routes prefill/decode "
    "pairs only (--prefill URL [PORT] and --decode URL)"
)
TENANT_KEYS = (
    "per-tenant data-plane keys are not supported: use --api-key or --data-plane-api-keys "
    "(ignoring it would leave the data plane open)"
)
TENANT_LIMITS = (
    "per-tenant rate limits and SMG's priority scheduler are not supported: use "
    "--max-concurrent-requests, --queue-size and --rate-limit-tokens-per-second (ignoring it "
    "would admit what it was meant to hold back)"
)
TOKENIZER = NOT_SERVED.format(routes="/v1/tokenize, /v1/detokenize or gRPC workers")
HISTORY = NOT_SERVED.format(routes="/v1/responses or /v1/conversations (their history store)")
GRPC = (
    "gRPC/ZMQ workers and the router's multimodal processing are not supported: trio_pd "
    "relays the client's body to HTTP PD engines, which do their own"
)
CACHE_TUNING = (
    "a knob of SMG 1.13's own cache-aware index and worker monitor; trio_pd's cache_aware is "
    "SGLang's approximate radix tree (--cache-threshold, --balance-*-threshold, "
    "--eviction-interval-secs, --max-tree-size) and its breakers and health checks"
)
MESH = (
    "SMG's HA mesh is not supported: replicas of trio_pd share membership through "
    "--etcd-endpoints (docs/scaling-out.md)"
)
RL = "SMG's RL control plane (weight updates fanned out to engines) is not served by trio_pd"
WASM = "WASM middleware and storage hooks are not supported by trio_pd"
WORKER_JOBS = (
    "trio_pd adds and removes workers at once (no job queue, no startup delay): "
    "--worker-startup-timeout-secs bounds the wait for the first ones"
)
STARTUP_PROBING = (
    "a starting worker is probed at the health-check interval (--health-check-interval-secs); "
    "the engines' loads are polled every --load-monitor-interval"
)
LOAD_MONITOR = (
    "trio_pd polls loads only where a policy or overload protection reads them (as this "
    "switch asks; trio_pd/fleet/loads.py)"
)
BUFFERING = (
    "trio_pd reads each body whole before routing it (bounded by --max-payload-size, "
    "--client-body-timeout-secs and --max-buffered-bytes), so every request is retryable"
)


def _rows(status: str, why: str, flags: Sequence[str], **kwargs: Any) -> list[Foreign]:
    refuse = (lambda value: True) if status == "refused" else (lambda value: False)
    return [Foreign(flag, why, status, refuse=refuse, kwargs=dict(kwargs)) for flag in flags]


def _ignored(why: str, flags: Sequence[str], **kwargs: Any) -> list[Foreign]:
    return _rows("ignored", why, flags, **kwargs)


LAUNCH_FOREIGN: tuple[Foreign, ...] = (
    *_rows("refused", UPSTREAM_HTTP2, ["--upstream-http2"], switch=True),
    *_rows("refused", EPD, ["--epd-disaggregation"], switch=True),
    *_rows("refused", EPD, ["--encode"], nargs="+", action="append"),
    *_rows("refused", EPD, ["--encode-selector"], nargs="+", action="extend"),
    *_rows(
        "refused", EPD, ["--encode-policy"], choices=["random", "round_robin", "consistent_hashing"]
    ),
    *_rows("refused", TENANT_KEYS, ["--tenant-api-key"], action="append"),
    *_rows(
        "refused",
        TENANT_LIMITS,
        ["--tenant-rate-limit-enabled", "--priority-scheduler-enabled"],
        switch=True,
    ),
    *_ignored(
        TENANT_LIMITS,
        [
            "--tenant-rate-limit-config",
            "--priority-scheduler-config",
            "--priority-scheduler-default-max-class",
        ],
    ),
    *_ignored(TENANT_LIMITS, ["--priority-scheduler-tenant-metric-top-n"], type=int),
    *_ignored(HISTORY, ["--trust-tenant-header", "--oracle-external-auth"], switch=True),
    *_ignored(HISTORY, ["--tenant-header-name", "--schema-config"]),
    *_ignored(HISTORY, ["--storage-context-headers"], nargs="*", action="extend"),
    *_ignored(
        HISTORY,
        [
            "--history-memory-max-responses",
            "--history-memory-max-items",
            "--history-memory-retention-secs",
            "--max-background-responses",
            "--postgres-op-timeout-secs",
            "--redis-op-timeout-secs",
        ],
        type=int,
    ),
    *_ignored(WASM, ["--enable-wasm"], switch=True),
    *_ignored(WASM, ["--storage-hook-wasm-path"]),
    *_ignored(TOKENIZER, ["--disable-tokenizer-autoload"], switch=True),
    *_ignored(TOKENIZER, ["--tokenizer-cache-l0-max-memory"], type=int),
    *_ignored(TOKENIZER, ["--parser"], choices=["legacy", "symphony"]),
    *_ignored(
        GRPC,
        [
            "--zmq-engine-count",
            "--multimodal-shm-min-bytes",
            "--multimodal-max-inflight-bytes",
            "--mm-per-request-image-limit",
            "--mm-pixel-cache-mb",
            "--rdma-slot-ttl-s",
        ],
        type=int,
    ),
    *_ignored(
        GRPC, ["--mm-pixel-rdma", "--mm-allow-private-media-hosts", "--log-mm-timing"], switch=True
    ),
    *_ignored(GRPC, ["--mm-allowed-media-domains", "--rdma-listen-ip"]),
    *_ignored(GRPC, ["--multimodal-tensor-transport"], choices=["inline", "shm", "auto", "rdma"]),
    *_ignored(GRPC, ["--mm-processing"], type=str.lower, choices=["auto", "router", "worker"]),
    *_ignored(
        CACHE_TUNING,
        [
            "--kv-index",
            "--selection-policy",
            "--kv-connector-annotation",
            "--kv-engine-id-annotation",
        ],
    ),
    *_ignored(CACHE_TUNING, ["--cache-index"], choices=["tree", "hash"]),
    *_ignored(CACHE_TUNING, ["--cache-boundaries"]),
    *_ignored(
        CACHE_TUNING,
        [
            "--block-size",
            "--cache-ttl-secs",
            "--selection-accounting-ttl-ms",
            "--worker-stall-secs",
            "--worker-wedge-secs",
            "--worker-stale-secs",
            "--worker-warmup-secs",
            "--worker-warmup-blocks",
            "--worker-warmup-divert-every",
        ],
        type=int,
    ),
    *_ignored(
        CACHE_TUNING,
        [
            "--balance-token-usage-threshold",
            "--overload-token-usage-threshold",
            "--overlap-decay",
            "--selection-temperature",
            "--worker-warmup-share",
            "--worker-warmup-thin-ratio",
        ],
        type=float,
    ),
    *_ignored(CACHE_TUNING, ["--dp-minimum-tokens-scheduler"], switch=True),
    *_ignored(MESH, ["--enable-mesh"], switch=True),
    *_ignored(
        MESH,
        [
            "--mesh-server-name",
            "--mesh-host",
            "--mesh-advertise-host",
            "--mesh-tls-ca-cert",
            "--mesh-tls-cert",
            "--mesh-tls-key",
        ],
    ),
    *_ignored(MESH, ["--mesh-port"], type=int),
    *_ignored(MESH, ["--mesh-peer-urls"], nargs="*", action="extend"),
    *_ignored(MESH, ["--router-selector"], nargs="+", action="extend"),
    *_ignored(RL, ["--enable-rl"], switch=True),
    *_ignored(RL, ["--rl-control-timeout-secs", "--rl-fanout-concurrency"], type=int),
    *_ignored(
        WORKER_JOBS,
        ["--job-queue-capacity", "--job-queue-concurrency", "--worker-startup-delay"],
        type=int,
    ),
    *_ignored(STARTUP_PROBING, ["--worker-startup-check-interval"], type=int),
    *_ignored(LOAD_MONITOR, ["--disable-load-monitoring"], switch=True),
    *_ignored("SMG's heap profiles of its Rust process", ["--jemalloc-prof-dir"]),
    *_ignored(
        "overload protection is on by default here as in SMG 1.13, where this switch only keeps "
        "it on (for older command lines): it changes nothing; --disable-worker-overload-protection "
        "turns it off",
        ["--worker-overload-protection"],
        switch=True,
    ),
    *_ignored(
        BUFFERING, ["--max-buffered-request-bytes", "--stream-body-stall-timeout-secs"], type=int
    ),
)


def launch_foreign() -> tuple[Foreign, ...]:
    """Every row launch adds to serve's: the SMG-only flags, ignored or refused."""
    return LAUNCH_FOREIGN


def widened_choices(values: Mapping[str, Any], given: Collection[str]) -> list[str]:
    """Errors for the values SMG 1.13 takes and the serve row does not."""
    errors = []
    for flag in dict.fromkeys(given):
        row = BY_NAME.get(flag)
        if row is None or flag not in WIDER_CHOICES or row.choices is None:
            continue
        value = values.get(row.dest)
        if value is not None and value not in row.choices:
            errors.append(f"{flag} {value}: {WIDER_CHOICES[flag][1]}")
    return errors


def metrics_host(host: str) -> str:
    """SMG 1.13's `--prometheus-host` when not given: the unspecified address of `host`'s
    family (bindings/python/src/lib.rs `metrics_host`)."""
    try:
        family = ipaddress.ip_address(host.strip("[]")).version
    except ValueError:
        family = 4
    return "::" if family == 6 else "0.0.0.0"


def build_launch_config(
    values: Mapping[str, Any], given: Collection[str], environ: Mapping[str, str]
) -> RouterConfig:
    """The RouterConfig of a parsed `trio-pd launch` line: launch's own rows judged (refused:
    one ConfigError; ignored: a startup warning), then serve's build over `LAUNCH_FLAGS`."""
    rows = {row.flag: row for row in launch_foreign()}
    errors, warnings = compat.check_values(values, given, rows)
    errors += widened_choices(values, given)
    if errors:
        raise ConfigError("; ".join(errors))
    values = dict(values)
    if values.get("prometheus_host") is None:
        values["prometheus_host"] = metrics_host(values.get("host") or "0.0.0.0")
    origins = values.get("cors_allowed_origins") or []
    if "*" in origins:  # SMG 1.13: `*` anywhere in the list is any origin (serve's empty list)
        values["cors_allowed_origins"] = []
    config = build_config(values, given, environ, table=LAUNCH_FLAGS)
    return attrs.evolve(
        config,
        cors_enabled=bool(origins),  # SMG 1.13: no origins given, no cross-origin allowance
        startup_warnings=(*warnings, *config.startup_warnings),
    )
