"""Every check of a finished RouterConfig, in one place, raising one error type.

The values come from the command line, a config file or the environment (`build.py`); what is
refused here is refused whatever the source, and the error names that source (`sources`: a
field's flag, or `$VAR`). SMG's own validation is kept where it has one (`config/validation.rs`:
ports, positive start-up settings, the rate and breaker window, the OTLP endpoint).
"""

from __future__ import annotations

import importlib
import math
import os
import re
from collections.abc import Callable, Mapping
from typing import NoReturn

from trio_pd.config.router import PolicyConfig, RouterConfig
from trio_pd.config.values import usable_key

HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token
TRACE_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
)
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


Fail = Callable[[str, str], NoReturn]  # (field, why): raise ConfigError naming the field's source
Where = Callable[[str], str]  # field -> its flag, or `$VAR`


class ConfigError(ValueError):
    """A configuration the router refuses to start with: the message says which value, and why."""


def check(config: RouterConfig, sources: Mapping[str, str]) -> None:
    """Raise ConfigError at the first problem of `config` (`sources[field]` names its flag)."""

    def where(field: str) -> str:
        return sources.get(field, field)

    def fail(field: str, why: str) -> NoReturn:
        raise ConfigError(f"{where(field)} {why}")

    for field, value in (
        ("max_sse_event_bytes", config.max_sse_event_bytes),
        ("load_poll_interval_secs", config.load_poll_interval_secs),
        ("health.startup_timeout_secs", config.health.startup_timeout_secs),
        ("tls_handshake_timeout_secs", config.tls_handshake_timeout_secs),
    ):
        if not value > 0:
            fail(field, f"must be > 0, not {value}")
    if config.max_buffered_bytes < 0:
        fail(
            "max_buffered_bytes", f"must be 0 (no budget) or more, not {config.max_buffered_bytes}"
        )
    check_ports(config, fail)
    check_edges(config, fail)
    check_admission(config, fail)
    check_overload(config, fail)
    check_policy(config, fail)
    check_keys(config, where)
    for name in config.request_id_headers or ():
        if not HEADER_NAME.fullmatch(name):
            raise ConfigError(f"{where('request_id_headers')}: {name!r} is not an HTTP header name")
    if config.etcd is not None and config.membership_file:
        raise ConfigError(
            "--etcd-endpoints and --membership-file are two membership stores: pick one"
        )
    check_discovery(config, fail)
    check_aliases(config, fail)
    if config.enable_trace:
        check_tracing(config, fail)


def check_ports(config: RouterConfig, fail: Fail) -> None:
    if config.prometheus_port is not None and not 0 <= config.prometheus_port <= 65535:
        fail("prometheus_port", f"must be a port number (0-65535), not {config.prometheus_port}")
    if not config.admin_port:
        return
    for field, host, port in (
        ("port", config.host, config.port),
        ("prometheus_port", config.prometheus_host, config.prometheus_port),
    ):
        same_host = (
            host == config.admin_host
            or host in WILDCARD_HOSTS
            or config.admin_host in WILDCARD_HOSTS
        )
        if port == config.admin_port and same_host:
            fail("admin_port", f"{config.admin_port} is also the {field} port: give the admin "
                 "listener its own")  # fmt: skip


def check_edges(config: RouterConfig, fail: Fail) -> None:
    """The connection edges: durations 0 (off) or more, and a probe port of its own (SMG 1.13
    refuses 0 there: probes need a stable port)."""
    edges = config.edges
    for field in (
        "sse_keepalive_secs",
        "header_read_timeout_secs",
        "idle_connection_timeout_secs",
        "upstream_pool_idle_timeout_secs",
    ):
        value = getattr(edges, field)
        if not value >= 0:
            fail(f"edges.{field}", f"must be 0 (off) or more, not {value}")
    if edges.max_client_connections < 0:
        fail(
            "edges.max_client_connections",
            f"must be 0 (derived) or more, not {edges.max_client_connections}",
        )
    port = edges.health_check_port
    if port is None:
        return
    if not 1 <= port <= 65535:
        fail("edges.health_check_port", f"must be a port number (1-65535), not {port}")
    for flag, taken in (
        ("--port", config.port),
        ("--prometheus-port", config.prometheus_port),
        ("--admin-port", config.admin_port),
    ):
        if taken == port:
            fail("edges.health_check_port", f"{port} is also {flag}: give the probes their own")


def check_discovery(config: RouterConfig, fail: Fail) -> None:
    """SMG's file discovery: the manifest is needed with the provider, and only there."""
    if config.discovery_provider == "file" and not config.discovery_file:
        fail("discovery_provider", "file needs --discovery-file (the manifest)")
    if config.discovery_provider == "file" and config.kubernetes is not None:
        fail("discovery_provider", "file and --service-discovery: give one provider")
    interval = config.discovery_check_interval_secs
    given_values = (
        ("discovery_file", config.discovery_file),
        ("discovery_check_interval_secs", interval),
    )
    for field, given in given_values:
        if given is not None and config.discovery_provider != "file":
            fail(field, "applies to --discovery-provider file only")
    if interval is not None and not interval > 0:
        fail("discovery_check_interval_secs", f"must be > 0, not {interval}")


def check_aliases(config: RouterConfig, fail: Fail) -> None:
    """An alias must not be the name of a model a worker of the command line serves: it would
    take that model's requests over (issue 26 N12). A worker that joins later serving such a
    name wins over the alias (`fleet/registry.py` `Fleet.models`)."""
    served = {spec.model_id for spec in (*config.prefill, *config.decode) if spec.model_id}
    for alias, canonical in config.model_aliases:
        if alias in served:
            fail(
                "model_aliases",
                f"{alias}={canonical}: {alias!r} is a model a worker serves; an alias may not "
                "shadow it",
            )


def check_admission(config: RouterConfig, fail: Fail) -> None:
    rate = config.rate_limit_tokens_per_second
    if rate is not None and rate < 0:
        fail("rate_limit_tokens_per_second", "must be >= 0")
    if config.breaker.window_duration_secs <= 0:
        fail("breaker.window_duration_secs", "must be > 0")
    if config.migration_limit < 0:
        fail("migration_limit", "must be >= 0")
    cap = config.max_concurrent_requests
    if 0 < cap < config.workers:
        fail("max_concurrent_requests", f"{cap} is below --workers {config.workers}: each "
             "process needs one slot at least (it is divided among them)")  # fmt: skip


def check_overload(config: RouterConfig, fail: Fail) -> None:
    """SMG's ranges: waiting requests >= 1, token usage in (0, 1], a queue and a wait."""
    overload = config.overload
    if overload.waiting_requests < 1:
        fail("overload.waiting_requests", f"must be 1 or more, not {overload.waiting_requests}")
    if not 0.0 < overload.token_usage <= 1.0:
        fail("overload.token_usage", f"must be in (0, 1], not {overload.token_usage}")
    size, timeout = overload.prefill_line
    if size < 0:
        fail("overload.prefill_queue_size", f"must be 0 or more, not {size}")
    if not timeout > 0:
        fail("overload.prefill_queue_timeout_secs", f"must be > 0, not {timeout}")
    if overload.pd_admission_wait_secs < 0:
        fail("overload.pd_admission_wait_secs", "must be 0 (no gate) or more")


def check_policy(config: RouterConfig, fail: Fail) -> None:
    """The bounds SGLang's router puts on the manual and bucket knobs."""
    policy = config.policy
    if policy.max_idle_secs < 0:
        fail("policy.max_idle_secs", f"must be 0 (never forget) or more: {policy.max_idle_secs}")
    if policy.for_role("prefill") == "bucket" and policy.bucket_adjust_interval_secs < 1:
        fail("policy.bucket_adjust_interval_secs",
             f"must be 1 or more: {policy.bucket_adjust_interval_secs}")  # fmt: skip
    if policy.for_role("prefill") == "kv_aware":
        path = policy.tokenizer_path
        if not path:
            fail("policy.tokenizer_path", "kv_aware needs the model's tokenizer: --tokenizer-path")
        elif not os.path.exists(
            path if not os.path.isdir(path) else os.path.join(path, "tokenizer.json")
        ):
            fail("policy.tokenizer_path", f"no tokenizer.json at {path}")
    if policy.kv_index_max_blocks < 1:
        fail("policy.kv_index_max_blocks", f"must be 1 or more: {policy.kv_index_max_blocks}")
    stale = policy.kv_events_stale_secs
    if not (math.isfinite(stale) and stale > 0):
        fail("policy.kv_events_stale_secs", f"must be a finite > 0: {stale}")
    check_routing(policy, fail)


def check_routing(policy: PolicyConfig, fail: Fail) -> None:
    """SMG 1.13's bounds on the least_load, prefix_hash and routing-key knobs."""
    weight = policy.least_load_kv_pressure_weight
    if not (math.isfinite(weight) and weight >= 0):
        fail("policy.least_load_kv_pressure_weight", f"must be a finite 0 or more: {weight}")
    rate = policy.least_load_default_throughput
    if not (math.isfinite(rate) and rate > 0):
        fail("policy.least_load_default_throughput", f"must be a finite > 0: {rate}")
    for field, count in (
        ("policy.least_load_mean_prefill_tokens", policy.least_load_mean_prefill_tokens),
        ("policy.prefix_token_count", policy.prefix_token_count),
    ):
        if count < 1:
            fail(field, f"must be 1 or more: {count}")
    for field, count in (
        ("policy.least_load_max_waiting_requests", policy.least_load_max_waiting_requests),
        ("policy.prefix_hash_balance_abs_threshold", policy.prefix_hash_balance_abs_threshold),
    ):
        if count < 0:
            fail(field, f"must be 0 or more: {count}")
    factor = policy.prefix_hash_load_factor
    if not (math.isfinite(factor) and factor >= 1.0):
        fail("policy.prefix_hash_load_factor", f"must be a finite 1.0 or more: {factor}")
    for name in policy.routing_key_headers:
        if not HEADER_NAME.fullmatch(name):
            fail("policy.routing_key_headers", f"{name!r} is not an HTTP header name")


def check_keys(config: RouterConfig, where: Where) -> None:
    """Keys go into Authorization headers: visible ASCII, wherever they came from; an error
    says which key (by position for a list), and never shows it."""
    for field in ("api_key", "worker_admin_api_key"):
        key = getattr(config, field)
        if key is not None and not usable_key(key):
            raise ConfigError(f"{where(field)} must be visible ASCII (it is sent in an "
                              f"Authorization header){hint(key)}")  # fmt: skip
    for n, key in enumerate(config.data_plane_api_keys, 1):
        if not usable_key(key):
            raise ConfigError(f"{where('data_plane_api_keys')}: key {n} must be visible ASCII "
                              f"(no spaces or control characters){hint(key)}")  # fmt: skip


def hint(key: str) -> str:
    """What is wrong with a key, without showing it: a trailing newline is the usual cause."""
    if key.endswith(("\n", "\r")):
        return " (it ends with a line break: a Secret or file written with a newline?)"
    return ""


def check_tracing(config: RouterConfig, fail: Fail) -> None:
    """`--otlp-traces-endpoint` as SMG checks it (only with `--enable-trace`), and the
    OpenTelemetry packages present: either missing is an error at startup, not a router that
    serves without the traces it was asked for."""
    endpoint = config.otlp_traces_endpoint
    problem = otlp_endpoint_problem(endpoint)
    if problem is not None:
        fail("otlp_traces_endpoint", f"{endpoint!r}: {problem}")
    for module in TRACE_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ConfigError(
                f"--enable-trace needs OpenTelemetry ({exc.name or module} is missing): "
                "pip install 'trio_pd[trace]'"
            ) from None


def otlp_endpoint_problem(endpoint: str) -> str | None:
    """What is wrong with a `<host>:<port>` collector address (SMG's config/validation.rs:
    a colon, a host before it, a port 1-65535 after it), or None."""
    scheme, sep, rest = endpoint.partition("://")
    address = rest if sep and scheme in ("http", "https") else endpoint
    host, colon, port = address.rpartition(":")
    if not colon:
        return "expected format <host>:<port>, e.g. otel-collector:4317 or 127.0.0.1:4317"
    if not host:
        return "host part cannot be empty"
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        return "port must be a number between 1 and 65535"
    return None
